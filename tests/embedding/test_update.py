"""`embedding.apply_gradients` against float64 numpy optimizer steps.

Every call that runs collectives is waited for before the next one starts
(XLA:CPU must not run two such programs at once).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lookup_reference import (
    JTE_OPTIMIZERS,
    ROWWISE_ADAM_OPTIMIZERS,
    TABLES,
    activation_grads,
    activations,
    apply_update,
    feature_specs,
    gather_all,
    make_batch,
    mesh_of,
    preprocess,
    row_gradients,
    touched,
)

import embedding

# Every test runs on the CPU kernels and on the pure-JAX path.
pytestmark = pytest.mark.usefixtures("lookup_path")

OPTIMIZERS = {
    "sgd": embedding.SGDOptimizerSpec(learning_rate=0.1),
    "sgd_schedule": embedding.SGDOptimizerSpec(learning_rate=lambda step: 0.2 / (1.0 + step)),
    "adagrad": embedding.AdagradOptimizerSpec(learning_rate=0.3, initial_accumulator_value=0.5),
    "rowwise_adagrad": embedding.RowWiseAdagradOptimizerSpec(
        learning_rate=0.3, initial_accumulator_value=0.2, epsilon=1e-3
    ),
    "adam": embedding.AdamOptimizerSpec(
        learning_rate=lambda step: 0.01 * (step + 1), beta_1=0.8, beta_2=0.9, epsilon=1e-3
    ),
    "ftrl": embedding.FTRLOptimizerSpec(
        learning_rate=0.5,
        l1_regularization_strength=0.05,
        l2_regularization_strength=0.1,
        beta=0.2,
        initial_accumulator_value=0.3,
        initial_linear_value=0.1,
    ),
    "ftrl_linear_by_lr": embedding.FTRLOptimizerSpec(
        learning_rate=0.5,
        learning_rate_power=-0.7,
        l1_regularization_strength=0.02,
        l2_regularization_strength=0.05,
        beta=0.1,
        initial_accumulator_value=0.4,
        multiply_linear_by_learning_rate=True,
    ),
    **ROWWISE_ADAM_OPTIMIZERS,
    **JTE_OPTIMIZERS,
}


def _run_steps(
    optimizers: dict, combiner: str, devices: int, slots: int, steps: int, *, positive=False
):
    """`steps` updates on fresh variables, each with its own batch
    (`positive`: activation gradients >= 0).

    Returns (before, after, reference, batches): gathered tables and slots
    before and after, and the float64 reference computed from `before`.
    """
    specs, mesh = feature_specs(combiner, optimizers, devices, slots), mesh_of(devices)
    variables = jax.block_until_ready(
        embedding.init_embedding_variables(jax.random.key(1), specs, mesh, num_sc_per_device=slots)
    )
    before = gather_all(variables, specs, mesh, slots)
    tables = {k: v.copy() for k, v in before[0].items()}
    slot_values = {t: {n: v.copy() for n, v in s.items()} for t, s in before[1].items()}
    batches = []
    for step in range(steps):
        batch = make_batch(10 + step)
        grads = activation_grads(step, positive=positive)
        variables = jax.block_until_ready(
            embedding.apply_gradients(
                grads, preprocess(batch, specs, devices, slots), variables, specs, mesh, step
            )
        )
        apply_update(optimizers, tables, slot_values, row_gradients(batch, combiner, grads), step)
        batches.append(batch)
    after = gather_all(variables, specs, mesh, slots)
    return before, after, (tables, slot_values), batches


def _per_table(a: str, bc: str) -> dict:
    return {"a": OPTIMIZERS[a], "b": OPTIMIZERS[bc], "c": OPTIMIZERS[bc]}


def _assert_close(actual, expected) -> None:
    np.testing.assert_allclose(actual, expected, rtol=2e-5, atol=2e-6)


# The optimizers whose owner update has a CPU kernel (`_cpu_kernels`).
_KERNEL_UPDATES = (
    "sgd",
    "adagrad",
    "rowwise_adagrad",
    "laprop",
    "adagrad_momentum",
    "f2a",
    "rowwise_adam",
)

# Each case runs two optimizers (one per stack) on one geometry, so that every
# optimizer and every device count is covered by few compilations.
CASES = [
    ("sgd", "adagrad", "mean", 1, 1),
    ("sgd_schedule", "adam", "mean", 4, 2),
    ("ftrl", "ftrl_linear_by_lr", "sqrtn", 2, 4),
    ("adam", "adagrad", "sum", 8, 1),
    ("rowwise_adagrad", "rowwise_adagrad", "mean", 2, 2),
    ("sgd", "rowwise_adagrad", "sum", 8, 1),
    ("rowwise_adam", "adam", "mean", 1, 1),
    ("rowwise_adam_decay", "rowwise_adam", "sqrtn", 2, 2),
    ("sgd", "rowwise_adam_decay", "sum", 8, 1),
]
# Each of jax-tpu-embedding's other optimizers on a table of its own ("a") and
# on a stack ("bc"), on one device, two (two partitions each) and eight.
JTE_CASES = [
    ("laprop", "adagrad_momentum_nesterov", "mean", 1, 1),
    ("adagrad_momentum", "f2a", "sum", 1, 1),
    ("f2a", "laprop", "sqrtn", 1, 1),
    ("laprop", "adagrad_momentum", "sum", 2, 2),
    ("adagrad_momentum", "f2a", "mean", 2, 2),
    ("f2a", "laprop", "sqrtn", 2, 2),
    ("adagrad_momentum_nesterov", "laprop", "sum", 8, 1),
    ("laprop", "f2a", "mean", 8, 1),
    ("f2a", "adagrad_momentum", "sqrtn", 8, 1),
]
# The JTE cases run three steps (F2A's boost needs a global step above 1) on
# activation gradients >= 0, so that a row's float32 gradient sum carries no
# cancellation (LaProp's g / sqrt(nu) would turn it into relative error of its
# slot), within rtol 1e-5; atol admits the float32 rounding of weights that
# an update brings near 0 (`w - lr * u`, operands near 1).
_RUNS = {
    "cases": ({"steps": 2}, {"rtol": 2e-5, "atol": 2e-6}),
    "jte_cases": ({"steps": 3, "positive": True}, {"rtol": 1e-5, "atol": 1e-6}),
}


@pytest.mark.parametrize(
    ("a", "bc", "combiner", "devices", "slots", "run"),
    [(*case, "cases") for case in CASES] + [(*case, "jte_cases") for case in JTE_CASES],
)
def test_optimizers_match_reference(a, bc, combiner, devices, slots, run):
    """Several steps (slots carry over, schedules and the step advance); rows
    never looked up keep their bits, in the table and in every slot."""
    steps, tolerance = _RUNS[run]
    before, after, reference, batches = _run_steps(
        _per_table(a, bc), combiner, devices, slots, **steps
    )
    looked_up = touched(*batches)
    for table in TABLES:
        rows, others = looked_up[table], ~looked_up[table]
        assert others.sum() > 50
        pairs = [(after[0][table], before[0][table], reference[0][table])]
        pairs += [
            (after[1][table][slot], before[1][table][slot], values)
            for slot, values in reference[1][table].items()
        ]
        for new, old, expected in pairs:
            np.testing.assert_allclose(new[rows], expected[rows], **tolerance)
            np.testing.assert_array_equal(new[others], old[others])
        assert not np.array_equal(after[0][table][rows], before[0][table][rows])


def test_minibatched_update_equals_single_pass():
    optimizer = OPTIMIZERS["adagrad"]
    mesh = mesh_of(2)
    batch, grads = make_batch(3), activation_grads(3)
    single = feature_specs("sum", optimizer, 2, 2)
    results = []
    for specs, minibatching in (
        (single, False),
        (feature_specs("sum", optimizer, 2, 2, limit=8), True),
    ):
        preprocessed = preprocess(batch, specs, 2, 2, enable_minibatching=minibatching)
        # Limits do not change the variables' shapes: both runs start alike.
        variables = jax.block_until_ready(
            embedding.init_embedding_variables(jax.random.key(1), single, mesh, num_sc_per_device=2)
        )
        variables = jax.block_until_ready(
            embedding.apply_gradients(
                grads,
                preprocessed,
                variables,
                specs,
                mesh,
                0,
                enable_minibatching=minibatching,
            )
        )
        results.append(gather_all(variables, specs, mesh, 2))
    assert (preprocessed.num_minibatches > 1).all()
    for table in TABLES:
        _assert_close(results[1][0][table], results[0][0][table])
        _assert_close(results[1][1][table]["accumulator"], results[0][1][table]["accumulator"])


@pytest.mark.parametrize("minibatching", [False, True])
def test_update_is_in_place(minibatching):
    """The compiled update aliases every table and slot to its output and
    holds no copy of a table-shaped buffer (also around the minibatch loop)."""
    devices, slots = 2, 2
    specs = feature_specs(
        "sum", OPTIMIZERS["adam"], devices, slots, limit=8 if minibatching else None
    )
    mesh = mesh_of(devices)
    variables = jax.eval_shape(
        lambda key: embedding.init_embedding_variables(key, specs, mesh, num_sc_per_device=slots),
        jax.random.key(0),
    )
    preprocessed = preprocess(
        make_batch(0), specs, devices, slots, enable_minibatching=minibatching
    )
    grads = activation_grads(0)
    step = jax.jit(
        lambda v: embedding.apply_gradients(
            grads, preprocessed, v, specs, mesh, 0, enable_minibatching=minibatching
        ),
        donate_argnums=0,
    )
    text = step.lower(variables).compile().as_text()
    shard_shapes = {
        f"f32[{v.table.shape[0] // devices},{v.table.shape[1]}]" for v in variables.values()
    }
    copies = [line for line in text.splitlines() if " copy(" in line]
    assert not [line for line in copies if any(s in line for s in shard_shapes)]
    header = text.splitlines()[0].split("entry_computation_layout")[0]
    num_buffers = sum(1 + len(v.slots) for v in variables.values())
    assert len(re.findall(r"(?:may|must)-alias", header)) == num_buffers


def test_fifty_steps_back_to_back_match_reference():
    """Lookup then update, 50 times on 8 devices, with loss 0.5 * sum(a^2)."""
    devices, slots, combiner = 8, 1, "sum"
    optimizer = embedding.SGDOptimizerSpec(learning_rate=0.01)
    specs, mesh = feature_specs(combiner, optimizer, devices, slots), mesh_of(devices)
    variables = jax.block_until_ready(
        embedding.init_embedding_variables(jax.random.key(2), specs, mesh, num_sc_per_device=slots)
    )
    tables, slot_values = gather_all(variables, specs, mesh, slots)
    batches = [make_batch(20 + i) for i in range(3)]
    inputs = [preprocess(b, specs, devices, slots) for b in batches]

    @jax.jit
    def train_step(variables, preprocessed, step):
        result = embedding.sparse_dense_matmul(preprocessed, variables, specs, mesh)
        return embedding.apply_gradients(result, preprocessed, variables, specs, mesh, step)

    for step in range(50):
        i = step % len(batches)
        variables = jax.block_until_ready(train_step(variables, inputs[i], jnp.int32(step)))
        grads = activations(tables, batches[i], combiner)
        optimizers = dict.fromkeys(TABLES, optimizer)
        apply_update(
            optimizers, tables, slot_values, row_gradients(batches[i], combiner, grads), step
        )
    after, _ = gather_all(variables, specs, mesh, slots)
    for table in TABLES:
        np.testing.assert_allclose(after[table], tables[table], rtol=1e-4, atol=1e-5)


def test_gradient_of_the_wrong_shape_is_rejected():
    specs, mesh = feature_specs("sum", OPTIMIZERS["sgd"], 2, 2), mesh_of(2)
    variables = jax.block_until_ready(
        embedding.init_embedding_variables(jax.random.key(0), specs, mesh, num_sc_per_device=2)
    )
    grads = activation_grads(0)
    grads["b1"] = grads["b1"][:, :4]
    with pytest.raises(ValueError, match=r"Feature 'b1'.*\[32, 4\].*\[32, 5\]"):
        embedding.apply_gradients(
            grads, preprocess(make_batch(0), specs, 2, 2), variables, specs, mesh, 0
        )


@pytest.mark.parametrize("minibatching", [False, True])
def test_update_with_the_forwards_layout_index_is_bitwise_the_same(minibatching):
    """Passing the forward's LayoutIndex skips reading the layout again and
    changes nothing; the index of one batch also serves a later program."""
    devices, slots = 2, 2
    optimizer = OPTIMIZERS["ftrl"]
    specs = feature_specs("sum", optimizer, devices, slots, limit=8 if minibatching else None)
    mesh = mesh_of(devices)
    batch, grads = make_batch(5), activation_grads(5)
    preprocessed = preprocess(batch, specs, devices, slots, enable_minibatching=minibatching)
    if minibatching:
        assert (preprocessed.num_minibatches > 1).all()
    results = []
    for with_index in (False, True):
        variables = jax.block_until_ready(
            embedding.init_embedding_variables(jax.random.key(3), specs, mesh, num_sc_per_device=2)
        )
        activations_, index = jax.block_until_ready(
            embedding.sparse_dense_matmul(
                preprocessed,
                variables,
                specs,
                mesh,
                enable_minibatching=minibatching,
                return_layout_index=True,
            )
        )
        variables = jax.block_until_ready(
            embedding.apply_gradients(
                grads,
                preprocessed,
                variables,
                specs,
                mesh,
                0,
                enable_minibatching=minibatching,
                layout_index=index if with_index else None,
            )
        )
        results.append(gather_all(variables, specs, mesh, slots))
    (tables, slot_values), (tables_index, slot_values_index) = results
    for table in TABLES:
        np.testing.assert_array_equal(tables_index[table], tables[table])
        for name, values in slot_values[table].items():
            np.testing.assert_array_equal(slot_values_index[table][name], values)


def test_layout_index_of_another_geometry_is_rejected():
    devices, slots = 2, 2
    specs, mesh = feature_specs("sum", OPTIMIZERS["sgd"], devices, slots), mesh_of(devices)
    variables = jax.block_until_ready(
        embedding.init_embedding_variables(jax.random.key(0), specs, mesh, num_sc_per_device=2)
    )
    preprocessed = preprocess(make_batch(0), specs, devices, slots)
    _, index = jax.block_until_ready(
        embedding.sparse_dense_matmul(
            preprocessed, variables, specs, mesh, return_layout_index=True
        )
    )
    rows, width = index.segments.shape
    cut = embedding.LayoutIndex(index.segments[:, :8])
    with pytest.raises(
        ValueError,
        match=rf"layout_index.segments has shape \[{rows}, 8\], expected \[{rows}, {width}\]",
    ):
        embedding.apply_gradients(
            activation_grads(0), preprocessed, variables, specs, mesh, 0, layout_index=cut
        )
    with pytest.raises(TypeError, match="layout_index must be the LayoutIndex"):
        embedding.apply_gradients(
            activation_grads(0), preprocessed, variables, specs, mesh, 0, layout_index=(1, 2)
        )


@pytest.mark.parametrize("optimizer", [*_KERNEL_UPDATES, "adam"])
def test_update_runs_in_the_kernel_in_place(optimizer, lookup_path):
    """On the kernel path the owner's merge and update of an optimizer with
    a kernel is one custom call per stack, its table and slots aliased to the
    outputs; on the other path none (the pure-JAX update runs, in place too)."""
    devices, slots = 2, 2
    specs, mesh = feature_specs("sum", OPTIMIZERS[optimizer], devices, slots), mesh_of(devices)
    variables = jax.eval_shape(
        lambda key: embedding.init_embedding_variables(key, specs, mesh, num_sc_per_device=slots),
        jax.random.key(0),
    )
    preprocessed = preprocess(make_batch(0), specs, devices, slots)
    grads = activation_grads(0)
    step = jax.jit(
        lambda v: embedding.apply_gradients(grads, preprocessed, v, specs, mesh, 0),
        donate_argnums=0,
    )
    text = step.lower(variables).compile().as_text()
    calls = re.findall(r'custom_call_target="sparseflow_update_(\w+)"', text)
    in_kernel = lookup_path == "cpu_kernels" and optimizer in _KERNEL_UPDATES
    assert calls == ([optimizer] * len(variables) if in_kernel else [])
    header = text.splitlines()[0].split("entry_computation_layout")[0]
    num_buffers = sum(1 + len(v.slots) for v in variables.values())
    assert len(re.findall(r"(?:may|must)-alias", header)) == num_buffers
