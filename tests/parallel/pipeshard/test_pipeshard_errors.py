"""Unsupported models and options fail early with a message naming the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from pipeshard_models import TrainState, mlp_batch, mlp_init, mlp_loss, train_step

from parallel import pipeshard

TX = optax.sgd(0.1)


def _inputs():
    rng = np.random.default_rng(0)
    params = mlp_init(rng)
    return TrainState(params, TX.init(params)), mlp_batch(rng)


def _build(step, **method):
    method.setdefault("num_micro_batches", 2)
    devices = method.pop("devices", None)
    function = pipeshard.parallelize(
        step, method=pipeshard.PipeshardParallel(**method), devices=devices
    )
    return function.get_executable(*_inputs())


def _step(loss):
    return train_step(pipeshard.value_and_grad, TX, loss)


def test_more_stages_than_devices():
    with pytest.raises(ValueError, match="4 stages but only 2 devices"):
        _build(_step(mlp_loss), devices=jax.devices()[:2])


def test_microbatches_must_divide_the_batch():
    with pytest.raises(ValueError, match=r"args\[1\]\['x'\].*num_micro_batches=5 must divide"):
        _build(_step(mlp_loss), num_micro_batches=5)


def _marker_in_scan(params, batch):
    def body(h, _):
        pipeshard.mark_pipeline_boundary()
        return jnp.tanh(h @ params["w0"]), None

    return jnp.mean(jax.lax.scan(body, batch["x"], length=2)[0])


def _marker_in_cond(params, batch):
    def branch(h):
        pipeshard.mark_pipeline_boundary()
        return h

    h = jax.lax.cond(params["w0"][0, 0] > 0, branch, lambda h: h, batch["x"] @ params["w0"])
    return jnp.mean(h)


def _marker_in_while(params, batch):
    def body(carry):
        pipeshard.mark_pipeline_boundary()
        return carry[0] + 1, jnp.tanh(carry[1])

    return jnp.mean(jax.lax.while_loop(lambda c: c[0] < 2, body, (0, batch["x"] @ params["w0"]))[1])


@pytest.mark.parametrize(
    ("loss", "primitive"),
    [(_marker_in_scan, "scan"), (_marker_in_cond, "cond"), (_marker_in_while, "while")],
)
def test_marker_inside_control_flow(loss, primitive):
    with pytest.raises(ValueError, match=rf"inside `{primitive}`.*top level of the loss"):
        _build(_step(loss))


def test_marker_inside_jit_is_inlined():
    """A jitted block may hold a marker: it is a single point of the program."""

    @jax.jit
    def block(params, h):
        h = jnp.tanh(h @ params["w0"])
        pipeshard.mark_pipeline_boundary()
        return jnp.tanh(h @ params["w1"])

    def loss(params, batch):
        return jnp.mean((block(params, batch["x"]) - batch["y"]) ** 2)

    assert _build(_step(loss)).layers.num_layers == 2


def test_manual_layers_need_a_marker():
    def loss(params, batch):
        return jnp.mean(jnp.tanh(batch["x"] @ params["w0"]))

    with pytest.raises(ValueError, match=r"needs at least one pipeshard.mark_pipeline_boundary"):
        _build(_step(loss))


def test_step_without_pipelined_gradient():
    with pytest.raises(ValueError, match="never calls pipeshard.value_and_grad"):
        _build(train_step(jax.value_and_grad, TX, mlp_loss))


def test_two_pipelined_gradients():
    def step(state, batch):
        first = pipeshard.grad(mlp_loss)(state.params, batch)
        second = pipeshard.grad(mlp_loss)(state.params, batch)
        return jax.tree.map(jnp.add, first, second)

    with pytest.raises(ValueError, match="takes 2 pipelined gradients"):
        _build(step)


def test_gradient_inside_jit_of_the_step():
    def step(state, batch):
        return jax.jit(pipeshard.grad(mlp_loss))(state.params, batch)

    with pytest.raises(ValueError, match="called inside jax.jit"):
        _build(step)


def test_computation_before_the_gradient():
    def step(state, batch):
        params = jax.tree.map(lambda p: p * 2.0, state.params)
        return pipeshard.grad(mlp_loss)(params, batch)

    with pytest.raises(ValueError, match="computes `mul` before pipeshard.value_and_grad"):
        _build(step)


def test_update_reading_the_batch():
    def step(state, batch):
        grads = pipeshard.grad(mlp_loss)(state.params, batch)
        return grads, jnp.sum(batch["x"])

    with pytest.raises(ValueError, match="reads its batch argument in `reduce_sum`"):
        _build(step)


def test_marker_outside_the_loss():
    def step(state, batch):
        grads = pipeshard.grad(mlp_loss)(state.params, batch)
        pipeshard.mark_pipeline_boundary()
        return grads

    with pytest.raises(ValueError, match="outside the loss"):
        _build(step)


def test_loss_must_be_a_float_scalar():
    def loss(params, batch):
        return mlp_loss(params, batch), 1.0

    with pytest.raises(TypeError, match="single scalar loss.*has_aux"):
        _build(_step(loss))


def test_uniform_stages_must_divide_the_layers():
    with pytest.raises(ValueError, match="num_stages=3.*divide the 4 layers"):
        _build(_step(mlp_loss), stage_option=pipeshard.UniformStageOption(num_stages=3))


def test_manual_stages_must_cover_the_layers():
    option = pipeshard.ManualStageOption(
        forward_stage_layer_ids=((0,), (1, 2)), submesh_device_counts=(4, 4)
    )
    with pytest.raises(ValueError, match="covers layers 0..2 but the model has 4 layers"):
        _build(_step(mlp_loss), stage_option=option)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_micro_batches": 0}, "num_micro_batches must be a positive integer"),
        ({"num_micro_batches": 2, "layer_option": "auto"}, "layer_option must be 'manual'"),
        ({"num_micro_batches": 2, "pipeline_schedule": "zigzag"}, "'gpipe', '1f1b'"),
        ({"num_micro_batches": 2, "loss_reduction": "max"}, "'mean', 'sum'"),
    ],
)
def test_invalid_options(options, message):
    with pytest.raises(ValueError, match=message):
        pipeshard.PipeshardParallel(**options)


@pytest.mark.parametrize(
    ("layer_ids", "message"),
    [(((0, 2), (1,)), "in order"), (((0,), ()), "non-empty group")],
)
def test_invalid_manual_stage_option(layer_ids, message):
    with pytest.raises(ValueError, match=message):
        pipeshard.ManualStageOption(forward_stage_layer_ids=layer_ids, submesh_device_counts=(4, 4))


def test_runtime_options_cannot_change_compilation():
    function = pipeshard.parallelize(
        _step(mlp_loss), method=pipeshard.PipeshardParallel(num_micro_batches=2)
    )
    with pytest.raises(
        ValueError, match=r"Only pipeline_schedule and time_tasks.*num_micro_batches"
    ):
        function.with_runtime_options(num_micro_batches=4)


def test_every_public_name_imports():
    namespace = {}
    exec("from parallel.pipeshard import *", namespace)  # noqa: S102 - the star import itself
    assert set(pipeshard.__all__) <= set(namespace)
    assert len(set(pipeshard.__all__)) == len(pipeshard.__all__)
