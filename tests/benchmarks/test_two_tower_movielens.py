"""The matrix-factorization baseline of benchmarks/two_tower_movielens.py."""

import numpy as np
from two_tower_movielens import _solve, als


def test_an_als_half_step_solves_every_rows_weighted_least_squares():
    rng = np.random.default_rng(1)
    fixed = rng.normal(size=(30, 4))
    observed = (rng.random((20, 30)) < 0.2).astype(np.float64)
    got = _solve(fixed, observed, 2.0, 3.0)
    for row in range(20):
        # Float64 numpy, row by row: (Y^T C Y + reg I) x = Y^T C p, C = 1 + alpha
        # on the observed pairs, p their 0/1 preference.
        confidence = 1 + 3.0 * observed[row]
        lhs = fixed.T @ (confidence[:, None] * fixed) + 2.0 * np.eye(4)
        want = np.linalg.solve(lhs, fixed.T @ (confidence * observed[row]))
        np.testing.assert_allclose(got[row], want, rtol=1e-9, atol=1e-12)


def test_als_ranks_a_users_unseen_cluster_items_first():
    # Users 0-3 take items 0-4, users 4-7 items 5-9; each user misses one item.
    users, items = [], []
    for user in range(8):
        cluster = range(0, 5) if user < 4 else range(5, 10)
        for item in cluster:
            if item % 5 != user % 4:
                users.append(user)
                items.append(item)
    u, v = als(np.array(users), np.array(items), 8, 10, 4, 0.1, 10.0)
    scores = u @ v.T
    for user in range(8):
        seen = set(np.array(items)[np.array(users) == user])
        missing = (0 if user < 4 else 5) + user % 4
        ranked = [i for i in np.argsort(-scores[user]) if i not in seen]
        assert ranked[0] == missing, (user, ranked)
