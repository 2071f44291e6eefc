"""`embedding.nnx`: the NNX layer against the functional lookup and update.

The reference of a training step is the functional path the trainer uses:
`embedding.sparse_dense_matmul`, `jax.value_and_grad` of the dense loss with
respect to the activations and the dense parameters, `embedding.apply_gradients`
for the tables and optax for the rest. The lookup is also checked against a
float64 numpy reference and a case small enough to check by hand.
"""

import dataclasses
import doctest
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from lookup_reference import (
    BATCH,
    activations,
    feature_specs,
    make_batch,
    mesh_of,
    preprocess,
)

import embedding
import embedding.nnx as enx

REPO = Path(__file__).resolve().parents[2]

OPTIMIZERS = {
    "sgd": embedding.SGDOptimizerSpec(learning_rate=0.1),
    "rowwise_adagrad": embedding.RowWiseAdagradOptimizerSpec(
        learning_rate=0.3, initial_accumulator_value=0.2, epsilon=1e-3
    ),
    "adam_schedule": embedding.AdamOptimizerSpec(
        learning_rate=lambda step: 0.01 * (step + 1), beta_1=0.8, beta_2=0.9, epsilon=1e-3
    ),
}
# The activations' width: features a1, a2 (dim 8), b1 (5), c1 (8).
WIDTH = 29
TARGETS = np.linspace(-1.0, 1.0, BATCH, dtype=np.float32)


class Model(nnx.Module):
    """The layer and a linear head on the activations side by side (in name order)."""

    def __init__(self, specs, mesh, *, rngs: nnx.Rngs, enable_minibatching: bool = False):
        self.embed = enx.Embed(
            specs, mesh, num_sc_per_device=1, rngs=rngs, enable_minibatching=enable_minibatching
        )
        self.head = nnx.Linear(WIDTH, 1, rngs=rngs)

    def __call__(self, batch):
        per_feature = self.embed(batch)
        return self.head(jnp.concatenate([per_feature[k] for k in sorted(per_feature)], 1))


def model_loss(model, batch, targets):
    return jnp.mean((model(batch)[:, 0] - targets) ** 2)


def dense_loss(per_feature, params, targets):
    """`model_loss` with the lookup done: the functional path's dense side."""
    x = jnp.concatenate([per_feature[k] for k in sorted(per_feature)], 1)
    return jnp.mean(((x @ params["kernel"] + params["bias"])[:, 0] - targets) ** 2)


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _start(optimizer: str, devices: int, *, limit: int | None = None, minibatching=False):
    """A fresh model, its optimizer and copies of its initial variables."""
    specs = feature_specs("sum", OPTIMIZERS[optimizer], devices, 1, limit=limit)
    model = Model(specs, mesh_of(devices), rngs=nnx.Rngs(0), enable_minibatching=minibatching)
    tx = optax.adam(0.01)
    start = (
        _copy(model.embed.embedding_variables()),
        _copy(nnx.to_pure_dict(nnx.state(model.head, nnx.Param))),
    )
    return model, enx.PartitionedOptimizer(model, tx), tx, start


def _functional_steps(model, tx, start, batches, *, minibatching=False):
    """The reference: the steps of `batches` on the functional API, from `start`.

    Each program with collectives is waited for before the next is dispatched
    (XLA:CPU must not run two such programs at once)."""
    specs, mesh = model.embed.feature_specs, model.embed.mesh
    variables, params = start
    opt_state, losses = tx.init(params), []
    for step, batch in enumerate(batches):
        per_feature = jax.block_until_ready(
            embedding.sparse_dense_matmul(
                batch, variables, specs, mesh, enable_minibatching=minibatching
            )
        )
        loss, (activation_grads, param_grads) = jax.value_and_grad(dense_loss, argnums=(0, 1))(
            per_feature, params, TARGETS
        )
        variables = jax.block_until_ready(
            embedding.apply_gradients(
                activation_grads,
                batch,
                variables,
                specs,
                mesh,
                step,
                enable_minibatching=minibatching,
            )
        )
        updates, opt_state = tx.update(param_grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(loss)
    return variables, params, losses


def _assert_matches(model, reference) -> None:
    variables, params, _ = reference
    actual = model.embed.embedding_variables()
    assert sorted(actual) == sorted(variables) == ["a", "bc"]
    for name, expected in variables.items():
        np.testing.assert_allclose(actual[name].table, expected.table, rtol=1e-5, atol=1e-7)
        assert actual[name].slots._fields == expected.slots._fields
        for got, want in zip(actual[name].slots, expected.slots, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    head = nnx.to_pure_dict(nnx.state(model.head, nnx.Param))
    for key in ("kernel", "bias"):
        np.testing.assert_allclose(head[key], params[key], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("devices", [1, 8])
def test_forward_equals_the_functional_lookup_and_a_float64_reference(devices):
    specs, mesh = feature_specs("mean", OPTIMIZERS["sgd"], devices, 1), mesh_of(devices)
    layer = enx.Embed(specs, mesh, num_sc_per_device=1, rngs=nnx.Rngs(3))
    batch = make_batch(5)
    preprocessed = preprocess(batch, specs, devices, 1)

    got = layer(preprocessed)

    variables = layer.embedding_variables()
    expected = embedding.sparse_dense_matmul(preprocessed, variables, layer.feature_specs, mesh)
    assert sorted(got) == ["a1", "a2", "b1", "c1"]
    for feature in got:
        np.testing.assert_array_equal(got[feature], expected[feature])
        assert got[feature].dtype == jnp.float32
    tables = embedding.gather_tables(
        {name: v.table for name, v in variables.items()},
        layer.feature_specs,
        mesh,
        num_sc_per_device=1,
    )
    reference = activations({k: v.astype(np.float64) for k, v in tables.items()}, batch, "mean")
    for feature, values in reference.items():
        np.testing.assert_allclose(got[feature], values, rtol=1e-5, atol=1e-6)


def test_lookup_of_a_hand_checkable_case():
    # Row i of the table is [2i, 2i + 1].
    table = embedding.TableSpec(
        name="t",
        vocabulary_size=6,
        embedding_dim=2,
        initializer=lambda key, shape, dtype: jnp.arange(math.prod(shape), dtype=dtype).reshape(
            shape
        ),
        optimizer=embedding.SGDOptimizerSpec(learning_rate=0.1),
        combiner="sum",
    )
    specs = {
        "f": embedding.FeatureSpec(
            name="f", table_spec=table, input_shape=[4, 2], output_shape=[4, 2]
        )
    }
    ids = [np.array([1, 3]), np.array([0]), np.array([2, 2]), np.array([5])]
    weights = [np.array([1.0, 0.5]), np.array([2.0]), np.array([1.0, 1.0]), np.array([1.0])]
    mesh = mesh_of(2)
    layer = enx.Embed(specs, mesh, num_sc_per_device=1, rngs=nnx.Rngs(0))
    ragged_ids, ragged_weights = np.empty(4, object), np.empty(4, object)
    ragged_ids[:], ragged_weights[:] = ids, [w.astype(np.float32) for w in weights]
    preprocessed, _ = embedding.preprocess_sparse_dense_matmul_input(
        {"f": ragged_ids}, {"f": ragged_weights}, layer.feature_specs, 2, 2, num_sc_per_device=1
    )

    got = np.asarray(layer(preprocessed)["f"])

    rows = np.arange(12, dtype=np.float64).reshape(6, 2)
    reference = np.stack([sum(w * rows[i] for i, w in zip(r, ws)) for r, ws in zip(ids, weights)])
    # 1*[2, 3] + 0.5*[6, 7]; 2*[0, 1]; [4, 5] + [4, 5]; [10, 11].
    np.testing.assert_array_equal(reference, [[5.0, 6.5], [0.0, 2.0], [8.0, 10.0], [10.0, 11.0]])
    np.testing.assert_array_equal(got, reference)


# (optimizer, devices, steps): SGD and row-wise Adagrad on one device and on
# eight; Adam with a schedule over two steps, so that the step the sparse
# optimizer sees must advance.
STEP_CASES = [
    ("sgd", 1, 1),
    ("sgd", 8, 1),
    ("rowwise_adagrad", 1, 1),
    ("rowwise_adagrad", 8, 1),
    ("adam_schedule", 1, 2),
]


@pytest.mark.parametrize(("optimizer", "devices", "steps"), STEP_CASES)
def test_training_steps_equal_the_functional_path(optimizer, devices, steps):
    """Table "a" alone (two features) and "b", "c" stacked: tables, slots,
    dense parameters and loss after eager `nnx.value_and_grad` steps."""
    model, partitioned, tx, start = _start(optimizer, devices)
    specs = model.embed.feature_specs
    batches = [preprocess(make_batch(20 + s), specs, devices, 1) for s in range(steps)]
    losses = []
    for batch in batches:
        loss, grads = nnx.value_and_grad(model_loss)(model, batch, TARGETS)
        # The eager backward pass updated copies: the model's tables still exist.
        assert not any(x.is_deleted() for x in jax.tree.leaves(model.embed.embedding_variables()))
        partitioned.update(model, grads)
        losses.append(loss)

    reference = _functional_steps(model, tx, start, batches)
    _assert_matches(model, reference)
    np.testing.assert_allclose(losses, reference[2], rtol=1e-5)
    assert int(model.embed.step[...]) == steps
    # optax keeps state for the dense head only, none for the tables.
    assert sorted(np.shape(x) for x in jax.tree.leaves(partitioned.opt_state)) == sorted(
        np.shape(x) for x in jax.tree.leaves(tx.init(start[1]))
    )


def test_a_minibatched_step_equals_the_functional_path():
    """Limits the batch exceeds: the layer looks up and updates minibatch by minibatch."""
    model, partitioned, tx, start = _start("sgd", 2, limit=24, minibatching=True)
    batch = preprocess(make_batch(3), model.embed.feature_specs, 2, 1, enable_minibatching=True)
    assert batch.num_minibatches.min() > 1

    loss, grads = nnx.value_and_grad(model_loss)(model, batch, TARGETS)
    partitioned.update(model, grads)

    reference = _functional_steps(model, tx, start, [batch], minibatching=True)
    _assert_matches(model, reference)
    np.testing.assert_allclose(loss, reference[2][0], rtol=1e-5)


def _jitted_train_step(model, partitioned):
    @nnx.jit(
        in_shardings=(
            enx.state_shardings(model),
            enx.state_shardings(partitioned),
            model.embed.input_sharding,
            None,
        ),
        donate_argnames=("model", "optimizer"),
    )
    def train_step(model, optimizer, batch, targets):
        loss, grads = nnx.value_and_grad(model_loss)(model, batch, targets)
        optimizer.update(model, grads)
        return loss

    return train_step


def test_jitted_step_with_state_shardings_keeps_the_tables_sharding():
    devices, steps = 8, 3
    model, partitioned, tx, start = _start("rowwise_adagrad", devices)
    batches = [
        preprocess(make_batch(20 + s), model.embed.feature_specs, devices, 1) for s in range(steps)
    ]
    train_step = _jitted_train_step(model, partitioned)

    # One step at a time: XLA:CPU must not run two programs with collectives at once.
    losses = [
        jax.block_until_ready((train_step(model, partitioned, batch, TARGETS), nnx.state(model)))[0]
        for batch in batches
    ]

    rows = jax.sharding.NamedSharding(model.embed.mesh, jax.sharding.PartitionSpec("x"))
    for variable in jax.tree.leaves(nnx.state(model, enx.EmbeddingParam)):
        assert variable.sharding == rows
    reference = _functional_steps(model, tx, start, batches)
    _assert_matches(model, reference)
    np.testing.assert_allclose(losses, reference[2], rtol=1e-5)
    assert int(model.embed.step[...]) == steps


def test_the_step_takes_the_lookup_path_in_force(lookup_path):
    """The CPU kernels, or the pure-JAX path of GPU and TPU, in lookup and
    update alike, even after a trace of the same layer on the other path."""
    model, partitioned, _, _ = _start("rowwise_adagrad", 2)
    batch = preprocess(make_batch(20), model.embed.feature_specs, 2, 1)
    program = _jitted_train_step(model, partitioned).lower(model, partitioned, batch, TARGETS)
    kernels = set(re.findall(r"sparseflow_[a-z_]+", program.as_text()))
    if lookup_path == "cpu_kernels":
        assert {"sparseflow_route", "sparseflow_update_rowwise_adagrad"} <= kernels
    else:
        assert not kernels


def test_loss_falls_on_a_learnable_problem():
    """Targets are sums of a hidden number per id: the tables must learn them."""
    vocab, dim, batch_size = 64, 4, 32
    table = embedding.TableSpec(
        name="t",
        vocabulary_size=vocab,
        embedding_dim=dim,
        initializer=embedding.initializers.Normal(stddev=0.1),
        optimizer=embedding.AdagradOptimizerSpec(learning_rate=0.5),
        combiner="sum",
    )
    specs = {
        "f": embedding.FeatureSpec(
            name="f", table_spec=table, input_shape=[batch_size, 2], output_shape=[batch_size, dim]
        )
    }
    mesh = mesh_of(2)

    class Regressor(nnx.Module):
        def __init__(self, rngs):
            self.embed = enx.Embed(specs, mesh, num_sc_per_device=1, rngs=rngs)
            self.head = nnx.Linear(dim, 1, rngs=rngs)

        def __call__(self, batch):
            return self.head(self.embed(batch)["f"])[:, 0]

    model = Regressor(nnx.Rngs(1))
    optimizer = enx.PartitionedOptimizer(model, optax.adam(0.05))
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=vocab).astype(np.float32)
    data = []
    for _ in range(4):
        ids = rng.integers(0, vocab, (batch_size, 2))
        batch, _ = embedding.preprocess_sparse_dense_matmul_input(
            {"f": ids}, None, model.embed.feature_specs, 2, 2, num_sc_per_device=1
        )
        data.append((batch, hidden[ids].sum(axis=1)))

    @nnx.jit
    def train_step(model, optimizer, batch, targets):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(batch) - targets) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(train_step(model, optimizer, *data[s % 4])) for s in range(40)]
    assert np.mean(losses[-4:]) < 0.1 * np.mean(losses[:4]), losses


def test_a_batch_for_other_specs_or_geometry_is_refused():
    devices = 2
    specs = feature_specs("sum", OPTIMIZERS["sgd"], devices, 1)
    layer = enx.Embed(specs, mesh_of(devices), num_sc_per_device=1, rngs=nnx.Rngs(0))
    batch = make_batch(1)

    # "b" and "c" not stacked: other stacks.
    with pytest.raises(ValueError, match=r"holds stacks \['a', 'b', 'c'\].*define \['a', 'bc'\]"):
        layer(preprocess(batch, _unstacked(specs), devices, 1))
    # Two partitions per device instead of one.
    with pytest.raises(
        ValueError, match=r"lhs_row_pointers\['a'\] has .* 2 devices x 1 partitions"
    ):
        layer(preprocess(batch, feature_specs("sum", OPTIMIZERS["sgd"], devices, 2), devices, 2))
    # Other limits: other buffer sizes.
    with pytest.raises(ValueError, match=r"lhs_embedding_ids\['a'\] has \d+ entries.*expects"):
        layer(
            preprocess(
                batch, feature_specs("sum", OPTIMIZERS["sgd"], devices, 1, limit=64), devices, 1
            )
        )
    with pytest.raises(TypeError, match="PreprocessedInput"):
        layer({"a1": np.zeros((BATCH, 4), np.int32)})


def _unstacked(specs):
    """The case's specs with every table in a stack of its own."""

    def alone(feature):
        table = dataclasses.replace(
            feature.table_spec, stacked_table_spec=None, setting_in_stack=None
        )
        return dataclasses.replace(feature, table_spec=table, id_transformation=None)

    return {name: alone(f) for name, f in specs.items()}


def test_a_plain_optimizer_and_gradients_without_the_tables_are_refused():
    model, partitioned, tx, _ = _start("sgd", 2)
    with pytest.raises(TypeError, match="PartitionedOptimizer"):
        enx.state_shardings(nnx.Optimizer(model, tx, wrt=nnx.Param))
    batch = preprocess(make_batch(1), model.embed.feature_specs, 2, 1)
    dense_only = nnx.All(nnx.Param, nnx.Not(enx.EmbeddingParam))
    grads = nnx.grad(model_loss, argnums=nnx.DiffState(0, dense_only))(model, batch, TARGETS)
    with pytest.raises(
        ValueError,
        match=r"no updated value for the embedding variables "
        r"\['embed/tables/a', 'embed/tables/bc'\]",
    ):
        partitioned.update(model, grads)
    with pytest.raises(ValueError, match="holds no embedding.nnx.Embed layer"):
        enx.PartitionedOptimizer(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), tx)


def test_the_package_docstring_example_runs():
    results = doctest.testmod(enx, optionflags=doctest.ELLIPSIS)
    assert results.attempted > 0
    assert results.failed == 0


def test_only_the_nnx_modules_import_flax():
    imports_flax = re.compile(r"^\s*(import flax|from flax)\b", re.MULTILINE)
    # The towers are NNX modules; `sparseflow.retrieval` runs trained NNX towers and is
    # imported only by its users (not by `sparseflow` or its commands).
    allowed = (
        REPO / "embedding" / "nnx",
        REPO / "sparseflow" / "towers",
        REPO / "sparseflow" / "retrieval",
    )
    # The trainer's view of its NNX model, which `_dense_model` imports when a run builds it.
    user_model = REPO / "sparseflow" / "_nnx_model.py"
    offenders = [
        str(path.relative_to(REPO))
        for package in ("embedding", "parallel", "pipelines", "beam_jobs", "sparseflow")
        for path in (REPO / package).rglob("*.py")
        if imports_flax.search(path.read_text())
        and not any(folder in path.parents for folder in allowed)
        and path != user_model
    ]
    assert not offenders
