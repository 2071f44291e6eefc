"""`embedding.sparse_dense_matmul` against a float64 numpy reference.

Every call that runs collectives is waited for before the next one starts
(XLA:CPU must not run two such programs at once).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lookup_reference import (
    BATCH,
    FEATURE_TABLES,
    TABLES,
    activations,
    feature_specs,
    gains,
    make_batch,
    mesh_of,
    preprocess,
)

import embedding

# Every test runs on the CPU kernels and on the pure-JAX path.
pytestmark = pytest.mark.usefixtures("lookup_path")

SGD = embedding.SGDOptimizerSpec(learning_rate=0.1)


def _setup(combiner: str, devices: int, slots: int, seed: int = 0):
    specs = feature_specs(combiner, SGD, devices, slots)
    mesh = mesh_of(devices)
    variables = jax.block_until_ready(
        embedding.init_embedding_variables(
            jax.random.key(seed), specs, mesh, num_sc_per_device=slots
        )
    )
    batch = make_batch(seed)
    preprocessed = preprocess(batch, specs, devices, slots)
    return specs, mesh, variables, batch, preprocessed


def _logical_tables(variables, specs, mesh, slots) -> dict[str, np.ndarray]:
    stacks = {name: v.table for name, v in variables.items()}
    return embedding.gather_tables(stacks, specs, mesh, num_sc_per_device=slots)


def _check_forward(combiner: str, devices: int, slots: int) -> None:
    specs, mesh, variables, batch, preprocessed = _setup(combiner, devices, slots)
    result = jax.block_until_ready(
        embedding.sparse_dense_matmul(preprocessed, variables, specs, mesh)
    )
    tables = _logical_tables(variables, specs, mesh, slots)
    expected = activations({k: v.astype(np.float64) for k, v in tables.items()}, batch, combiner)
    assert set(result) == set(FEATURE_TABLES)
    for feature, values in result.items():
        assert values.shape == (BATCH, TABLES[FEATURE_TABLES[feature]][1])
        np.testing.assert_allclose(values, expected[feature], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_every_combiner_matches_reference(combiner):
    _check_forward(combiner, devices=4, slots=2)


@pytest.mark.parametrize(("devices", "slots"), [(1, 1), (1, 4), (2, 2), (8, 1), (8, 4)])
def test_every_geometry_matches_reference(devices, slots):
    _check_forward("sum", devices, slots)


def test_activations_are_sharded_by_rows():
    specs, mesh, variables, _, preprocessed = _setup("sum", devices=8, slots=1)
    result = jax.block_until_ready(
        embedding.sparse_dense_matmul(preprocessed, variables, specs, mesh)
    )
    shards = result["a1"].addressable_shards
    assert len(shards) == 8
    assert {shard.data.shape for shard in shards} == {(BATCH // 8, 8)}


def test_minibatched_input_gives_the_single_pass_activations():
    """Limits of 8 ids per partition force a split; the result must not change."""
    specs, mesh, variables, _, single = _setup("sqrtn", devices=2, slots=2)
    small = feature_specs("sqrtn", SGD, 2, 2, limit=8)
    split = preprocess(make_batch(0), small, 2, 2, enable_minibatching=True)
    assert (split.num_minibatches > 1).all()
    expected = jax.block_until_ready(embedding.sparse_dense_matmul(single, variables, specs, mesh))
    result = jax.block_until_ready(
        embedding.sparse_dense_matmul(split, variables, small, mesh, enable_minibatching=True)
    )
    for feature in FEATURE_TABLES:
        np.testing.assert_allclose(result[feature], expected[feature], rtol=1e-5, atol=1e-6)


def _dense_loss(tables, batch, combiner, weights):
    """The same loss on logical tables, with `jnp.take` and a segment sum."""
    total = 0.0
    for feature, table in FEATURE_TABLES.items():
        rows = batch.ids[feature]
        ids = np.concatenate(rows)
        samples = np.repeat(np.arange(BATCH), [len(r) for r in rows])
        row_gains = np.concatenate([gains(w, combiner) for w in batch.weights[feature]]).astype(
            np.float32
        )
        looked_up = jnp.take(tables[table], ids, axis=0) * row_gains[:, None]
        pooled = jax.ops.segment_sum(looked_up, samples, num_segments=BATCH)
        total = total + jnp.sum(pooled * weights[feature])
    return total


@pytest.mark.parametrize("combiner", ["mean"])
def test_table_gradient_matches_dense_lookup(combiner):
    slots = 2
    specs, mesh, variables, batch, preprocessed = _setup(combiner, devices=4, slots=slots)
    rng = np.random.default_rng(1)
    weights = {
        f: rng.normal(size=(BATCH, TABLES[t][1])).astype(np.float32)
        for f, t in FEATURE_TABLES.items()
    }

    def sharded_loss(variables):
        result = embedding.sparse_dense_matmul(preprocessed, variables, specs, mesh)
        return sum(jnp.sum(result[f] * weights[f]) for f in FEATURE_TABLES)

    grads = jax.block_until_ready(jax.grad(sharded_loss)(variables))
    logical = _logical_tables(grads, specs, mesh, slots)
    tables = {k: jnp.asarray(v) for k, v in _logical_tables(variables, specs, mesh, slots).items()}
    expected = jax.grad(_dense_loss)(tables, batch, combiner, weights)
    for table in TABLES:
        np.testing.assert_allclose(logical[table], expected[table], rtol=1e-5, atol=1e-5)


def test_mismatched_device_count_is_rejected():
    specs, _, variables, _, preprocessed = _setup("sum", devices=4, slots=2)
    with pytest.raises(ValueError, match="device counts"):
        embedding.sparse_dense_matmul(preprocessed, variables, specs, mesh_of(2))


def test_missing_stack_is_rejected():
    specs, mesh, variables, _, preprocessed = _setup("sum", devices=2, slots=2)
    del variables["bc"]
    with pytest.raises(ValueError, match="embedding_variables holds stacks"):
        embedding.sparse_dense_matmul(preprocessed, variables, specs, mesh)


def test_two_dimensional_mesh_is_rejected():
    specs, _, variables, _, preprocessed = _setup("sum", devices=2, slots=2)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    with pytest.raises(ValueError, match="1-D mesh"):
        embedding.sparse_dense_matmul(preprocessed, variables, specs, mesh)


def test_slots_of_another_optimizer_are_rejected():
    specs, mesh, variables, _, preprocessed = _setup("sum", devices=2, slots=2)
    table = variables["bc"].table
    variables["bc"] = embedding.EmbeddingVariables(
        table, embedding.AdagradSlots(accumulator=jnp.zeros_like(table))
    )
    with pytest.raises(ValueError, match="slots are a AdagradSlots.*keeps SGDSlots"):
        embedding.sparse_dense_matmul(preprocessed, variables, specs, mesh)


def test_a_misshapen_per_row_slot_is_rejected():
    rowwise = embedding.RowWiseAdagradOptimizerSpec(learning_rate=0.1)
    specs, mesh = feature_specs("sum", rowwise, 2, 2), mesh_of(2)
    variables = embedding.init_embedding_variables(
        jax.random.key(0), specs, mesh, num_sc_per_device=2
    )
    rows = variables["bc"].table.shape[0]
    assert variables["bc"].slots.accumulator.shape == (rows,)
    variables["bc"] = variables["bc"]._replace(
        slots=embedding.RowWiseAdagradSlots(jnp.zeros_like(variables["bc"].table))
    )
    preprocessed = preprocess(make_batch(0), specs, 2, 2)
    with pytest.raises(ValueError, match=rf"slot 'accumulator' has shape .*expected \[{rows}\]"):
        embedding.sparse_dense_matmul(preprocessed, variables, specs, mesh)


@pytest.mark.parametrize("devices, slots", [(1, 2), (2, 2)])
def test_alike_features_put_side_by_side_in_stack_order_are_the_pooled_block(devices, slots):
    """Stack "a" pools its features a1 and a2 example by example
    (`_feature_blocks.pooled_positions`): the two put side by side, as the
    trainer stacks them, are the pooled block itself, with no transpose in
    the program (the layout numbers the samples feature after feature)."""
    specs, mesh, variables, _, preprocessed = _setup("sum", devices, slots)

    def side_by_side(variables):
        result = embedding.sparse_dense_matmul(preprocessed, variables, specs, mesh)
        return jnp.concatenate([result["a1"], result["a2"]], axis=1)

    program = jax.jit(side_by_side).lower(variables).compile().as_text()
    assert " transpose(" not in program
