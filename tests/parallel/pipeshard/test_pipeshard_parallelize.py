"""Pipeshard steps equal the unparallelized step: loss, gradients, update.

The reference is `jax.value_and_grad` plus the same optax optimizer, jitted
as one program. Each parallelized function is compiled once per (model,
stages, microbatches, layers) and shared by both schedules, which run the
same programs in another order.
"""

import functools

import jax
import numpy as np
import optax
import pytest
from pipeshard_models import (
    TrainState,
    mlp_batch,
    mlp_init,
    mlp_loss,
    train_step,
    transformer_batch,
    transformer_init,
    transformer_loss,
)

from parallel import pipeshard

TX = optax.adam(0.05)
MODELS = {
    "mlp": (mlp_loss, lambda rng: mlp_init(rng), mlp_batch),
    "tied_mlp": (mlp_loss, lambda rng: mlp_init(rng, tied=True), mlp_batch),
    "transformer": (transformer_loss, transformer_init, transformer_batch),
}
SCHEDULES = ["gpipe", "1f1b"]


@functools.cache
def _reference(model):
    return jax.jit(train_step(jax.value_and_grad, TX, MODELS[model][0]))


def _inputs(model, seed=0):
    _, init, batch = MODELS[model]
    rng = np.random.default_rng(seed)
    params = init(rng)
    return TrainState(params, TX.init(params)), batch(rng)


@functools.cache
def _compiled(model, num_stages, m, layers="manual"):
    """A pipeshard step, compiled for `_inputs(model)`."""
    layer_option = "manual" if layers == "manual" else pipeshard.AutoLayerOption(layer_num=layers)
    stage_option = pipeshard.UniformStageOption(num_stages=num_stages)
    method = pipeshard.PipeshardParallel(
        num_micro_batches=m, layer_option=layer_option, stage_option=stage_option
    )
    step = pipeshard.parallelize(
        train_step(pipeshard.value_and_grad, TX, MODELS[model][0]), method=method
    )
    step.get_executable(*_inputs(model))
    return step


def _assert_tree_close(got, want, rtol=1e-5, atol=1e-6):
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol),
        got,
        want,
    )


def _assert_steps_match(step, model, steps=2, atol=1e-6):
    """`steps` consecutive steps give the reference's (state, loss, grads)."""
    state, batch = _inputs(model)
    reference_state = state
    for _ in range(steps):
        got = step(state, batch)
        want = _reference(model)(reference_state, batch)
        _assert_tree_close(got, want, atol=atol)
        state, reference_state = got[0], want[0]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("num_stages", [2, 4])
def test_mlp_matches_reference(num_stages, m, schedule):
    step = _compiled("mlp", num_stages, m).with_runtime_options(pipeline_schedule=schedule)
    _assert_steps_match(step, "mlp")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("num_stages", [2, 4])
def test_mlp_automatic_layers_match_reference(num_stages, schedule):
    step = _compiled("mlp", num_stages, 2, layers=4).with_runtime_options(
        pipeline_schedule=schedule
    )
    _assert_steps_match(step, "mlp")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("num_stages", [2, 4])
def test_tied_weights_match_reference(num_stages, schedule):
    """`w0` is read by the first and the last stage; its gradients are summed."""
    step = _compiled("tied_mlp", num_stages, 4).with_runtime_options(pipeline_schedule=schedule)
    executable = step.get_executable(*_inputs("tied_mlp"))
    readers = {
        p.stage for p in executable.program.pieces for v in p.step_inputs if v.aval.shape == (8, 8)
    }
    assert {0, num_stages - 1} <= readers
    _assert_steps_match(step, "tied_mlp")


@pytest.mark.parametrize(
    ("num_stages", "m", "layers", "schedule"),
    [(2, 2, "manual", "gpipe"), (4, 4, "manual", "1f1b"), (2, 4, 2, "1f1b")],
)
def test_transformer_matches_reference(num_stages, m, layers, schedule):
    step = _compiled("transformer", num_stages, m, layers).with_runtime_options(
        pipeline_schedule=schedule
    )
    # Microbatching sums every gradient in another order than the reference.
    # In float32, through attention, softmax and two Adam steps, that moves
    # parameters by a few 1e-6 (up to 2.6e-6 seen, the amount depending on
    # the CPU's kernels). A lost or doubled microbatch moves them by the
    # order of an Adam update (learning rate 0.05), far above this atol.
    _assert_steps_match(step, "transformer", atol=1e-5)


def test_manual_stages_with_uneven_submeshes_match_reference():
    method = pipeshard.PipeshardParallel(
        num_micro_batches=4,
        stage_option=pipeshard.ManualStageOption(
            forward_stage_layer_ids=((0,), (1, 2), (3,)), submesh_device_counts=(2, 4, 2)
        ),
        pipeline_schedule="1f1b",
    )
    step = pipeshard.parallelize(train_step(pipeshard.value_and_grad, TX, mlp_loss), method=method)
    _assert_steps_match(step, "mlp")
    assert step.get_executable(*_inputs("mlp")).plan.device_counts == (2, 4, 2)


def test_automatic_stages_match_reference():
    method = pipeshard.PipeshardParallel(
        num_micro_batches=2,
        stage_option=pipeshard.AutoStageOption(num_stages=2, submesh_sizes=(4,), profile_repeats=1),
    )
    step = pipeshard.parallelize(train_step(pipeshard.value_and_grad, TX, mlp_loss), method=method)
    _assert_steps_match(step, "mlp", steps=1)
    plan = step.get_executable(*_inputs("mlp")).plan
    assert plan.device_counts == (4, 4)
    assert sum(plan.stage_layer_ids, ()) == (0, 1, 2, 3)


def test_updated_parameters_live_on_their_stage_submesh():
    step = _compiled("mlp", 4, 2)
    state, batch = _inputs("mlp")
    new_state, _, _ = step(state, batch)
    meshes = step.get_executable(state, batch).meshes
    for i in range(4):
        assert new_state.params[f"w{i}"].sharding.device_set == set(meshes[i].devices.flat)


def test_sum_reduced_loss_matches_reference():
    def loss(params, batch):
        return mlp_loss(params, batch) * batch["x"].shape[0]

    state, batch = _inputs("mlp")
    method = pipeshard.PipeshardParallel(
        num_micro_batches=4,
        stage_option=pipeshard.UniformStageOption(num_stages=2),
        loss_reduction="sum",
    )
    step = pipeshard.parallelize(train_step(pipeshard.value_and_grad, TX, loss), method=method)
    want = jax.jit(train_step(jax.value_and_grad, TX, loss))(state, batch)
    _assert_tree_close(step(state, batch), want)


def test_stage_function_returns_parameter_and_activation_gradients():
    """The dense-tower form: activations come in, their gradients go out."""

    def loss(params, activations, batch):
        return mlp_loss(params, {"x": activations, "y": batch["y"]})

    rng = np.random.default_rng(1)
    params, batch = mlp_init(rng), mlp_batch(rng)
    activations, labels = batch["x"], {"y": batch["y"]}
    method = pipeshard.PipeshardParallel(
        num_micro_batches=4, stage_option=pipeshard.UniformStageOption(num_stages=2)
    )
    dense = pipeshard.pipeshard_value_and_grad(loss, method=method)
    got = dense(params, activations, labels)
    want = jax.value_and_grad(loss, argnums=(0, 1))(params, activations, labels)
    _assert_tree_close(got, want)
    assert got[1][1].shape == activations.shape


def test_many_steps_back_to_back():
    """Dozens of steps dispatched without pauses: no deadlock, same trajectory.

    Every backward task all-reduces inside its stage, so this exercises the
    one-collective-program-in-flight rule on XLA:CPU.
    """
    step = _compiled("mlp", 2, 4)
    state, batch = _inputs("mlp")
    reference_state = state
    for _ in range(30):
        state, loss, _ = step(state, batch)
        reference_state, reference_loss, _ = _reference("mlp")(reference_state, batch)
    _assert_tree_close((state, loss), (reference_state, reference_loss), rtol=1e-4)


def test_a_batch_sharded_over_the_devices_is_cut_by_one_tracked_program(monkeypatch):
    """Its microbatches move rows between devices: a program with collectives.

    Cut by indexing, the driver dispatched one such program per microbatch,
    all in flight at once beside the schedule's own, which XLA:CPU can
    deadlock on (a rare hang, then the process aborted). Now indexing a
    device array during the step fails the test, and the cut is one program
    the driver waits for like every other collective one.
    """
    from jax._src.array import ArrayImpl

    from parallel.pipeshard import _runtime

    step = _compiled("mlp", 2, 4)
    state, batch = _inputs("mlp")
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    sharded = jax.device_put(
        batch, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    )
    step(state, sharded)  # compiles the cut before indexing is forbidden

    def no_indexing(self, index):
        raise AssertionError(f"a device array of shape {self.shape} was indexed eagerly")

    tracked = []

    class Recording(type(_runtime.COLLECTIVES_IN_FLIGHT)):
        def track(self, outputs):
            tracked.append([x.shape for x in jax.tree.leaves(outputs)])
            super().track(outputs)

    monkeypatch.setattr(ArrayImpl, "__getitem__", no_indexing)
    monkeypatch.setattr(_runtime, "COLLECTIVES_IN_FLIGHT", Recording())
    got = step(state, sharded)
    size = batch["x"].shape[0] // 4
    cut = sorted([(size, *batch[k].shape[1:]) for k in batch for _ in range(4)])
    assert cut in [sorted(shapes) for shapes in tracked]
    monkeypatch.undo()
    _assert_tree_close(got, _reference("mlp")(state, batch))
