"""A pipeshard dense tower as the TC stage of SC/TC step pipelining.

`pipeshard_tc_function` wraps `pipeshard_value_and_grad` and an optax
optimizer into a `parallel.TcStageFun`. The pipeline is driven from the
host: one compiled program per stage and task, dispatched by the host in
the schedule's order. So the pipelined step runs with
`parallel.host_driven_step` (the sparse stages compiled, the TC stage
from the host), never under `jax.jit`:

    tc = pipeshard.pipeshard_tc_function(loss_fn, optax.adam(1e-3), method=method)
    train_state = pipeshard.TcTrainState.create(params, optax.adam(1e-3))
    state = parallel.get_initial_state(batch(0), train_state, tables, sc_fwd, tc)
    run_step = parallel.host_driven_step(sc_fwd, tc, sc_bwd)
    for t in range(parallel.get_pipeline_train_steps(n)):
        out, _, train_state, tables, state = run_step(
            batch(t) if t < n else dummy, train_state, tables, state,
            fake_tc_step=not parallel.is_output_valid(t, n))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from parallel.pipeshard._api import PipeshardFunction, pipeshard_value_and_grad
from parallel.pipeshard._options import PipeshardParallel


class TcTrainState(NamedTuple):
    """The dense side of training for `pipeshard_tc_function`.

    Attributes:
      params: the dense tower's parameters (a pytree of arrays).
      opt_state: their optax optimizer state.
      step: `int32[]`, dense updates applied so far.
    """

    params: Any
    opt_state: optax.OptState
    step: Any  # shape=(), dtype=int32

    @classmethod
    def create(cls, params: Any, optimizer: optax.GradientTransformation) -> TcTrainState:
        """The state before the first update: `optimizer.init(params)`, step 0."""
        return cls(params, optimizer.init(params), jnp.zeros((), jnp.int32))


def pipeshard_tc_function(
    loss_fn: Callable[[Any, Any, Any], Any],
    optimizer: optax.GradientTransformation,
    *,
    method: PipeshardParallel,
    devices: Sequence[jax.Device] | None = None,
) -> PipeshardTcStage:
    """A `parallel.TcStageFun` running the dense tower as a pipeshard pipeline.

    Each call runs `loss_fn`'s forward and backward pass on the stages'
    sub-meshes with microbatches (`pipeshard_value_and_grad`), moves the
    gradients back to where the parameters and activations live, and applies
    `optimizer`. Make it once and pass the same object to every call: the
    pipeline is compiled on the first call.

    Run it with `parallel.host_driven_step` (or `parallel.step` eagerly,
    waiting for each call's outputs before the next: XLA:CPU must not run
    two programs with collectives at once). It cannot be traced: under
    `jax.jit` (`parallel.jit_step`, a jitted `parallel.step`) it raises
    `HostDrivenStageError`. `parallel.get_initial_state` learns its output
    shapes from `shape_function`, the same stage written with
    `jax.value_and_grad`, which only `jax.eval_shape` runs.

    Args:
      loss_fn: `loss_fn(params, activations, dense_inputs) -> float32[]`,
        with pipeline markers (or automatic layers); `activations` and every
        leaf of `dense_inputs` are split into microbatches along axis 0.
      optimizer: the optax optimizer of the dense parameters.
      method: the pipeline options.
      devices: the devices to slice into stages; all devices by default.

    Returns:
      A `PipeshardTcStage` `tc(activations, dense_inputs, train_state,
      sc_fwd_aux=None) -> (activation_grads, loss, new_train_state, tc_aux)`, where
      `train_state` is a `TcTrainState`, `activation_grads` has the
      structure and shardings of `activations`, `loss` is `float32[]` and
      `tc_aux` is the batch's dense step (`train_state.step`, `int32[]`, for
      the embedding optimizer's learning rate). `sc_fwd_aux` is not used.

    Raises:
      TypeError: `optimizer` is not an optax `GradientTransformation`.
    """
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"optimizer must be an optax GradientTransformation (e.g. optax.adam(1e-3)), "
            f"got {type(optimizer).__name__}."
        )
    return PipeshardTcStage(
        pipeshard_value_and_grad(loss_fn, method=method, devices=devices),
        traceable=jax.value_and_grad(loss_fn, argnums=(0, 1)),
        update=_update_function(optimizer),
    )


class PipeshardTcStage:
    """The TC stage `pipeshard_tc_function` makes (see there).

    Attributes:
      pipeshard_function: the pipelined dense tower, e.g. for its
        `last_schedule`.
    """

    def __init__(self, pipeshard_function: PipeshardFunction, *, traceable, update):
        self.pipeshard_function = pipeshard_function
        self._traceable, self._update = traceable, update
        self._jitted_update = jax.jit(update)

    def __call__(self, activations, dense_inputs, train_state: TcTrainState, sc_fwd_aux=None):
        del sc_fwd_aux
        _check_train_state(train_state)
        args = (train_state.params, activations, dense_inputs)
        check_not_traced(args, "pipeshard_tc_function")
        loss, (param_grads, activation_grads) = self.pipeshard_function(*args)
        param_grads = like(param_grads, train_state.params)
        activation_grads = like(activation_grads, activations)
        loss = like(loss, train_state.step)
        return (
            activation_grads,
            loss,
            self._jitted_update(train_state, param_grads),
            train_state.step,
        )

    def shape_function(self, activations, dense_inputs, train_state, sc_fwd_aux=None):
        """The stage with `jax.value_and_grad`, traceable: for output shapes only."""
        del sc_fwd_aux
        loss, (param_grads, activation_grads) = self._traceable(
            train_state.params, activations, dense_inputs
        )
        return activation_grads, loss, self._update(train_state, param_grads), train_state.step


def _update_function(optimizer: optax.GradientTransformation):
    def update(state: TcTrainState, param_grads: Any) -> TcTrainState:
        updates, opt_state = optimizer.update(param_grads, state.opt_state, state.params)
        return TcTrainState(optax.apply_updates(state.params, updates), opt_state, state.step + 1)

    return update


class HostDrivenStageError(TypeError):
    """A host-driven pipeshard stage was traced (e.g. under `jax.jit`)."""


def check_not_traced(tree: Any, what: str) -> None:
    """Raises `HostDrivenStageError` if `tree` holds tracers: the pipeline cannot be traced.

    Raises:
      HostDrivenStageError: saying why, and what would run instead.
    """
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree)):
        raise HostDrivenStageError(
            f"{what} runs its dense tower as a pipeshard pipeline driven from the host (one "
            "compiled program per stage and microbatch task, dispatched in the schedule's "
            "order), so it cannot run inside jax.jit, parallel.jit_step or another trace. "
            "Drive the step from the host with parallel.host_driven_step(sc_fwd, tc, sc_bwd) "
            "(or parallel.step called eagerly). Under jax.jit only an unpipelined TC stage "
            "would run (jax.value_and_grad of the loss as one program): pass such a stage "
            "instead if that is what you want."
        )


def like(tree: Any, reference: Any) -> Any:
    """`tree` placed like `reference` (the pipeline leaves results on stage sub-meshes).

    Where `reference` is not committed to devices (host values, or the
    placeholders of `parallel.get_initial_state` without shardings), the
    result is not either, so it combines with arrays on any devices.
    """

    def place(x, r):
        if isinstance(r, jax.Array) and r.committed:
            return jax.device_put(x, r.sharding)
        return jnp.asarray(jax.device_get(x))

    return jax.tree.map(place, tree, reference)


def _check_train_state(train_state: Any) -> None:
    if not isinstance(train_state, TcTrainState):
        raise TypeError(
            "the pipeshard TC stage's train state must be a TcTrainState(params, opt_state, "
            f"step), got {type(train_state).__name__}; build it with TcTrainState.create."
        )
