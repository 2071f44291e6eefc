"""`recall_at_k`: how many held-out interactions a retrieval model ranks in its top K."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

# Rows scored at once: a chunk's scores are float64[_CHUNK, num_items].
_CHUNK = 512


def recall_at_k(
    user_vectors: ArrayLike,
    item_vectors: ArrayLike,
    held_out_items: ArrayLike,
    *,
    k: int,
    exclude: Sequence[ArrayLike] | None = None,
) -> float:
    """The share of held-out interactions whose item is among the user's top `k` items.

    Every item is scored by `<user vector, item vector>` (in float64) and
    ranked by score, ties by item id (the lower first); the items in
    `exclude[i]` (the user's training items, which a recommender does not
    show again) are left out of row i's ranking, except its own held-out
    item. A user with several held-out interactions has a row for each,
    so this is `sum over users |top k & held-out items| / held-out interactions`.

    Args:
      user_vectors: `float[n, d]`, the user's vector for each held-out interaction.
      item_vectors: `float[num_items, d]`, row j the vector of item id j.
      held_out_items: `int[n]`, the item id of each held-out interaction.
      k: the list length, `1 <= k <= num_items`.
      exclude: n arrays of item ids, or None to rank every item.

    Returns:
      recall@k in [0, 1].

    Raises:
      ValueError: shapes that do not match, an item id out of range, a bad `k`.
    """
    users = np.asarray(user_vectors, np.float64)
    items = np.asarray(item_vectors, np.float64)
    targets = np.asarray(held_out_items)
    _check(users, items, targets, k, exclude)
    hits = 0
    for start in range(0, len(targets), _CHUNK):
        rows = slice(start, start + _CHUNK)
        scores = users[rows] @ items.T
        if exclude is not None:
            _exclude(scores, exclude[rows], targets[rows])
        hits += int(np.sum(_ranks(scores, targets[rows]) < k))
    return hits / len(targets)


def _ranks(scores: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """`int[rows]`: the items ranked before each row's target (higher score, or equal
    score and lower id); excluded items score -inf and never come before a target."""
    target_scores = scores[np.arange(len(targets)), targets][:, None]
    lower_id = np.arange(scores.shape[1])[None, :] < targets[:, None]
    before = (scores > target_scores) | ((scores == target_scores) & lower_id)
    return before.sum(axis=1)


def _exclude(scores: np.ndarray, exclude: Sequence[ArrayLike], targets: np.ndarray) -> None:
    for row, (items, target) in enumerate(zip(exclude, targets, strict=True)):
        items = np.asarray(items, np.int64)
        scores[row, items[items != target]] = -np.inf


def _check(users, items, targets, k, exclude) -> None:
    if users.ndim != 2 or items.ndim != 2 or users.shape[1] != items.shape[1]:
        raise ValueError(
            f"user_vectors must be float[n, d] and item_vectors float[num_items, d], got "
            f"{list(users.shape)} and {list(items.shape)}."
        )
    if targets.shape != (users.shape[0],) or not np.issubdtype(targets.dtype, np.integer):
        raise ValueError(
            f"held_out_items must be int[n] with n = {users.shape[0]} (a row of user_vectors "
            f"each), got {targets.dtype}{list(targets.shape)}."
        )
    if not len(targets):
        raise ValueError("recall_at_k needs at least one held-out interaction, got none.")
    if targets.min() < 0 or targets.max() >= items.shape[0]:
        raise ValueError(
            f"held_out_items must be item ids in [0, {items.shape[0]}) (rows of item_vectors), "
            f"got ids from {targets.min()} to {targets.max()}."
        )
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= items.shape[0]:
        raise ValueError(f"k must be an int in [1, {items.shape[0]}] (the items), got {k!r}.")
    if exclude is not None and len(exclude) != len(targets):
        raise ValueError(
            f"exclude must hold one array of item ids per held-out interaction "
            f"({len(targets)}), got {len(exclude)}."
        )
