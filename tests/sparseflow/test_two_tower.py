"""The two-tower retrieval model: its loss, recall@K, its records, and training it."""

from __future__ import annotations

import doctest
import logging
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf
import yaml
from flax import nnx
from train_cases import assert_bitwise_equal_runs, cli

import embedding
import pipelines
import sparseflow
import sparseflow_serving
from embedding import nnx as enx
from sparseflow import _export, _train, retrieval, shipped_config, towers

NUM_USERS, NUM_ITEMS, CLUSTERS = 240, 480, 8


def _planted_interactions(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(users, items, times)`: each user picks 90% of their items from the items of
    their own cluster (Zipf-popular within it), 10% from all items; ids from 1."""
    rng = np.random.default_rng(seed)
    users = np.repeat(np.arange(1, NUM_USERS + 1), 64)
    per_cluster = NUM_ITEMS // CLUSTERS
    popularity = 1.0 / np.arange(1, per_cluster + 1)
    within = rng.choice(per_cluster, users.size, p=popularity / popularity.sum())
    items = 1 + (users % CLUSTERS) * per_cluster + within
    noise = rng.random(users.size) < 0.1
    items[noise] = rng.integers(1, NUM_ITEMS + 1, noise.sum())
    return users, items, rng.permutation(users.size)


def _brute_force_recall(users, items, targets, k, exclude) -> float:
    """Float64 numpy: each row's full ranking by (-score, id), excluded items removed."""
    hits = 0
    for row, target in enumerate(targets):
        scores = np.asarray(items, np.float64) @ np.asarray(users[row], np.float64)
        order = np.lexsort((np.arange(len(scores)), -scores))
        dropped = set(np.asarray(exclude[row]).tolist()) - {int(target)}
        ranked = [i for i in order if i not in dropped]
        hits += int(target in ranked[:k])
    return hits / len(targets)


def test_recall_at_k_of_a_hand_derived_case():
    users = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    items = np.array([[3.0, 0.0], [1.0, 2.0], [2.0, 1.0], [0.0, 0.0]])
    # Scores: row 0 [3, 1, 2, 0]; row 1 [0, 2, 1, 0]; row 2 [3, 3, 3, 0].
    # Row 0, target 2, item 0 excluded: ranks [2, 1, 3], a hit at k=1.
    # Row 1, target 0, nothing excluded: ranks [1, 2, 0, 3] (0 before 3 by id): 3rd.
    # Row 2, target 2 ties items 0 and 1, which come first by id; item 1 is
    # excluded, so 2 is 2nd; its own id in `exclude` is ignored.
    exclude = [[0], [], [1, 2]]
    targets = np.array([2, 0, 2])
    got = [retrieval.recall_at_k(users, items, targets, k=k, exclude=exclude) for k in (1, 2, 3)]
    assert got == [1 / 3, 2 / 3, 1.0]
    assert retrieval.recall_at_k(users, items, targets, k=1) == 0.0


def test_recall_at_k_equals_a_float64_brute_force_ranking():
    rng = np.random.default_rng(3)
    users = rng.normal(size=(700, 4)).astype(np.float32)  # more rows than one chunk
    items = rng.normal(size=(50, 4)).astype(np.float32)
    items[7] = items[3]  # a tie
    targets = rng.integers(0, 50, 700)
    exclude = [rng.choice(50, rng.integers(0, 20), replace=False) for _ in range(700)]
    for k in (1, 5, 10):
        want = _brute_force_recall(users, items, targets, k, exclude)
        assert retrieval.recall_at_k(users, items, targets, k=k, exclude=exclude) == want


@pytest.mark.parametrize(
    ("args", "k", "message"),
    [
        ((np.ones((2, 3)), np.ones((4, 2)), np.array([0, 1])), 1, "float[n, d]"),
        ((np.ones((2, 2)), np.ones((4, 2)), np.array([0])), 1, "int[n] with n = 2"),
        ((np.ones((2, 2)), np.ones((4, 2)), np.array([0.0, 1.0])), 1, "int[n] with n = 2"),
        ((np.ones((2, 2)), np.ones((4, 2)), np.array([0, 4])), 1, "item ids in [0, 4)"),
        ((np.ones((2, 2)), np.ones((4, 2)), np.array([0, 1])), 5, "k must be an int in [1, 4]"),
        ((np.ones((0, 2)), np.ones((4, 2)), np.zeros(0, int)), 1, "at least one"),
    ],
)
def test_recall_at_k_refuses_bad_input(args, k, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        retrieval.recall_at_k(*args, k=k)


def test_the_package_example_runs():
    # Row 0 ranks item 2 first once item 0 is excluded; row 1 ranks item 1 first.
    results = doctest.testmod(retrieval)
    assert results.attempted and not results.failed


def test_held_out_last_takes_each_users_latest_interactions():
    users = np.array([5, 5, 5, 2, 2, 9])
    times = np.array([30, 10, 30, 7, 8, 1])
    # User 5: times 10, 30, 30 (the tie: the later row last); user 2: 7, 8;
    # user 9 has one interaction only and keeps it.
    assert retrieval.held_out_last(users, times).tolist() == [0, 0, 1, 0, 1, 0]
    assert retrieval.held_out_last(users, times, per_user=2).tolist() == [1, 0, 1, 0, 0, 0]
    with pytest.raises(ValueError, match="per_user must be an int >= 1"):
        retrieval.held_out_last(users, times, per_user=0)


def test_recent_items_are_the_users_earlier_known_items():
    users = np.array([1, 2, 1, 1, 2, 1])
    items = np.array([10, 20, 11, 12, 21, 13])
    times = np.array([5, 1, 3, 9, 2, 7])
    # User 1 in time order: 11 (t3), 10 (t5), 13 (t7), 12 (t9); user 2: 20, 21.
    got = retrieval.recent_items(users, items, times, length=2)
    assert [r.tolist() for r in got] == [[11], [], [], [10, 13], [20], [11, 10]]
    known = np.array([True, True, True, True, True, False])  # 13 unknown
    got = retrieval.recent_items(users, items, times, length=5, known=known)
    assert [r.tolist() for r in got] == [[11], [], [], [11, 10], [20], [11, 10]]


def test_write_interactions_writes_ids_log_q_and_label(tmp_path):
    paths = retrieval.write_interactions(
        tmp_path,
        {"user_id": [4, 5, 6, 4], "recent": [[], [3, 4], [5], []], "item_id": [1, 2, 1, 1]},
        item_feature="item_id",
        num_shards=2,
    )
    assert [p.rsplit("/", 1)[1] for p in paths] == [
        "part-00000-of-00002.array_record",
        "part-00001-of-00002.array_record",
    ]
    rows = []
    for record in pipelines.read_records(paths):
        feature = tf.train.Example.FromString(record).features.feature
        rows.append(
            (
                feature["user_id"].int64_list.value[0],
                list(feature["recent"].int64_list.value),
                feature["item_id"].int64_list.value[0],
                feature["log_q"].float_list.value[0],
                feature["label"].int64_list.value[0],
            )
        )
    log_q = [np.log(3 / 4), np.log(1 / 4), np.log(3 / 4), np.log(3 / 4)]
    np.testing.assert_allclose([r[3] for r in rows], log_q, rtol=1e-6)
    assert [r[:3] + r[4:] for r in rows] == [
        (4, [], 1, 1),
        (5, [3, 4], 2, 1),
        (6, [5], 1, 1),
        (4, [], 1, 1),
    ]
    with pytest.raises(ValueError, match="one length"):
        retrieval.write_interactions(
            tmp_path, {"user_id": [1], "item_id": [1, 2]}, item_feature="item_id"
        )


def _numpy_in_batch_loss(logits, labels) -> float:
    logits = np.asarray(logits, np.float64)
    log_softmax = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return -np.sum(labels * np.diag(log_softmax)) / max(labels.sum(), 1)


def test_in_batch_softmax_loss_is_the_cross_entropy_of_the_diagonal():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 6)).astype(np.float32)
    labels = np.array([1, 1, 0, 1, 0, 1], np.int32)
    got = towers.in_batch_softmax_loss(jnp.asarray(logits), jnp.asarray(labels))
    np.testing.assert_allclose(float(got), _numpy_in_batch_loss(logits, labels), rtol=1e-6)
    zero = towers.in_batch_softmax_loss(jnp.asarray(logits), jnp.zeros(6, jnp.int32))
    assert float(zero) == 0.0


def _embed(batch: int = 8) -> enx.Embed:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    specs = {}
    for name, vocabulary in (("user_id", 50), ("item_id", 60), ("genre", 10)):
        table = embedding.TableSpec(
            name=name,
            vocabulary_size=vocabulary,
            embedding_dim=4,
            initializer=embedding.initializers.Normal(stddev=0.5),
            optimizer=embedding.SGDOptimizerSpec(learning_rate=0.1),
            combiner="sum",
        )
        specs[name] = embedding.FeatureSpec(
            name=name, table_spec=table, input_shape=[batch, 1], output_shape=[batch, 4]
        )
    return enx.Embed(specs, mesh, num_sc_per_device=1, rngs=nnx.Rngs(0))


def _numpy_tower(layers, x) -> np.ndarray:
    for index, layer in enumerate(layers):
        x = x @ np.asarray(layer.kernel[...], np.float64) + np.asarray(layer.bias[...], np.float64)
        x = np.maximum(x, 0) if index < len(layers) - 1 else x
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_the_logits_are_cosines_over_the_temperature_minus_log_q():
    embed = _embed()
    model = towers.TwoTower(
        embed,
        2,
        user_features=["user_id"],
        item_features=["item_id", "genre"],
        hidden=[5],
        dim=3,
        temperature=0.2,
        log_q_column=1,
        rngs=nnx.Rngs(1),
    )
    rng = np.random.default_rng(0)
    ids = {name: rng.integers(0, 10, (8, 1)) for name in ("user_id", "item_id", "genre")}
    batch, _ = embedding.preprocess_sparse_dense_matmul_input(
        ids, None, embed.feature_specs, embed.mesh.size, embed.mesh.size, num_sc_per_device=1
    )
    dense = rng.normal(size=(8, 2)).astype(np.float32)
    logits = np.asarray(model(batch, dense))

    tables = embedding.gather_tables(
        {name: table[...] for name, table in embed.tables.items()},
        embed.feature_specs,
        embed.mesh,
        num_sc_per_device=1,
    )
    rows = {name: np.asarray(tables[name], np.float64)[ids[name][:, 0]] for name in ids}
    u = _numpy_tower(model.user_tower, rows["user_id"])
    v = _numpy_tower(model.item_tower, np.concatenate([rows["item_id"], rows["genre"]], axis=1))
    want = u @ v.T / 0.2 - np.asarray(dense[:, 1], np.float64)[None, :]
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)


def test_a_user_tower_output_of_zero_has_finite_gradients():
    # No hidden layer and zero biases: a user without ids has a zero vector.
    model = towers.TwoTower(
        _embed(),
        0,
        user_features=["user_id"],
        item_features=["item_id"],
        hidden=[],
        log_q_column=None,
        rngs=nnx.Rngs(0),
    )
    activations = {"user_id": jnp.zeros((3, 4))}
    vectors = model.user_vectors(activations)
    grads = nnx.grad(lambda m: jnp.sum(m.user_vectors(activations)[:, 0]))(model)
    assert np.array_equal(np.asarray(vectors), np.zeros((3, 32)))
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(grads))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"user_features": [], "item_features": ["item_id"]}, "non-empty list"),
        ({"user_features": ["user"], "item_features": ["item_id"]}, "names ['user'], not"),
        ({"user_features": ["user_id"], "item_features": ["user_id"]}, "['user_id'] are in"),
        ({"user_features": ["user_id"], "item_features": ["item_id"], "dim": 0}, "positive"),
        ({"user_features": ["user_id"], "item_features": ["item_id"], "temperature": 0}, "> 0"),
        ({"user_features": ["user_id"], "item_features": ["item_id"], "log_q_column": 2}, "None"),
    ],
)
def test_a_two_tower_of_bad_arguments_is_refused(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        towers.TwoTower(_embed(), 2, rngs=nnx.Rngs(0), **args)


def _two_tower_config(tmp_path, *, steps: int = 160, **model_args):
    raw = yaml.safe_load(shipped_config("two_tower").read_text())
    raw["dataset"] = {"dir": str(tmp_path)}
    # Input in process: an idle-priority worker starves while other work loads the cores.
    raw["training"].update(steps=steps, epochs=16, log_every=20, checkpoint_every=2, workers=0)
    raw["model"]["args"].update(model_args)
    path = tmp_path / "two_tower.yaml"
    path.write_text(yaml.safe_dump(raw))
    return sparseflow.load_config(path)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """`(config, records, split)` of planted interactions, each user's last held out."""
    tmp = tmp_path_factory.mktemp("two_tower")
    users, items, times = _planted_interactions(seed=0)
    held = retrieval.held_out_last(users, times)
    recent = retrieval.recent_items(users, items, times, length=20, known=~held)
    train = {"user_id": users[~held], "item_id": items[~held]}
    train["recent_items"] = [recent[r] for r in np.flatnonzero(~held)]
    records = retrieval.write_interactions(
        tmp / "records", train, item_feature="item_id", num_shards=2
    )
    test = {"user_id": users[held], "item_id": items[held]}
    test["recent_items"] = [recent[r] for r in np.flatnonzero(held)]
    return _two_tower_config(tmp), records, (train, test)


def test_a_trained_two_tower_beats_popularity_on_planted_clusters(planted, caplog):
    config, records, (train, test) = planted
    with caplog.at_level(logging.INFO, logger="sparseflow._train"):
        result = sparseflow.Trainer(config).fit(records, eval_data=records, progress=False)
    assert "not per-example logits: no AUC" in caplog.text
    assert np.isnan(result.train_auc) and result.eval_auc is None
    assert np.mean(result.losses[-20:]) < 0.8 * np.mean(result.losses[:20])

    # Item ids from 1: row 0 of the tables is no item and is not ranked.
    seen = [train["item_id"][train["user_id"] == user] - 1 for user in test["user_id"]]
    counts = np.bincount(train["item_id"] - 1, minlength=NUM_ITEMS).astype(np.float64)
    popular = retrieval.recall_at_k(
        np.ones((len(seen), 1)), counts[:, None], test["item_id"] - 1, k=10, exclude=seen
    )
    trained = retrieval.TrainedTwoTower.from_result(config, result)
    item_vectors = trained.item_vectors({"item_id": np.arange(1, NUM_ITEMS + 1)})
    user_vectors = trained.user_vectors(test)
    recall = retrieval.recall_at_k(
        user_vectors, item_vectors, test["item_id"] - 1, k=10, exclude=seen
    )
    assert recall >= 1.5 * popular, (recall, popular)

    # The vectors are the towers on the trained tables' rows, the recent
    # items averaged (the items table's combiner), in float64 numpy.
    tables = embedding.gather_tables(
        {name: v.table for name, v in result.embedding_variables.items()},
        config.feature_specs,
        _train.make_mesh(config.mesh.devices),
        num_sc_per_device=1,
    )
    users, items = (np.asarray(tables[name], np.float64) for name in ("users", "items"))
    recent = np.stack(
        [items[r].mean(axis=0) if r.size else items[0] * 0 for r in test["recent_items"]]
    )
    want_users = _numpy_tower(
        trained.model.user_tower, np.concatenate([users[test["user_id"]], recent], axis=1)
    )
    want_items = _numpy_tower(trained.model.item_tower, items[1 : NUM_ITEMS + 1])
    np.testing.assert_allclose(user_vectors, want_users, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(item_vectors, want_items, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_two_tower_run_resumes_bitwise_after_a_crash(planted, tmp_path, pipelined):
    config, records, _ = planted
    options = dict(data=records, steps=4, progress=False, pipelined=pipelined)
    whole = _train.train(config, _train.TrainOptions(**options))
    # The command line trains the same 4 steps but ends abruptly after step 2
    # (its checkpoint written, nothing in flight drained), as a kill -9 would.
    checkpoints = tmp_path / "checkpoints"
    crashed = cli(
        *("train", "--config", str(config.source_path), "--data", str(Path(records[0]).parent)),
        *("--steps", "4", "--pipelined" if pipelined else "--no-pipelined", "--no-progress"),
        *("--checkpoint-dir", str(checkpoints), "--stop-after", "2"),
    )
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    resumed = _train.train(
        config, _train.TrainOptions(**options, checkpoint_dir=checkpoints, resume=True)
    )
    assert_bitwise_equal_runs(resumed, whole)


def test_the_export_holds_every_items_vector_of_the_checkpoint(planted, tmp_path):
    config, records, _ = planted
    checkpoints = tmp_path / "checkpoints"
    result = sparseflow.Trainer(config).fit(
        records, steps=4, checkpoint_dir=checkpoints, progress=False
    )
    exported = _export.export_model(config, checkpoints, tmp_path / "export")
    model = sparseflow_serving.load_exported(exported.path)
    ids, vectors = model.items()
    assert model.manifest["items"]["feature"] == "item_id"
    vocabulary = config.tables["items"].vocabulary_size
    np.testing.assert_array_equal(ids, np.arange(vocabulary))
    # The item tower of the run's end on every row of the items table, in float64 numpy.
    trained = retrieval.TrainedTwoTower.from_result(config, result)
    np.testing.assert_array_equal(model.tables["items"], trained.tables["item_id"])
    items = np.asarray(model.tables["items"], np.float64)
    np.testing.assert_allclose(
        vectors, _numpy_tower(trained.model.item_tower, items), rtol=1e-4, atol=1e-5
    )
    with pytest.raises(ValueError, match="two-tower model"):
        model.score({}, np.zeros((1, 1)))
