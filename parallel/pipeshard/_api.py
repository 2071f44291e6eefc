"""`parallelize`: a train step into a pipeshard-parallel callable."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax

from parallel.pipeshard._apply import build_apply_pieces
from parallel.pipeshard._grad import value_and_grad
from parallel.pipeshard._options import AutoStageOption, PipeshardParallel
from parallel.pipeshard._plot import TimelineAxis, plot_schedule
from parallel.pipeshard._profile import stage_timer
from parallel.pipeshard._program import slice_program
from parallel.pipeshard._runtime import PipeshardExecutable, check_runtime_options
from parallel.pipeshard._schedules import ExecutedSchedule
from parallel.pipeshard._stages import construct_stages, slice_devices
from parallel.pipeshard._tracing import abstract_leaf, differentiate, trace_step


class PipeshardFunction:
    """A train step run as a pipeline of data-parallel stages.

    Calling it runs one step: the batch arguments are split into
    microbatches, every stage runs its forward and backward on them in the
    schedule's order on its own sub-mesh, gradients are summed per stage and
    the rest of the step (the update) runs per stage. Results equal the
    unparallelized step's (up to floating-point summation order) and live on
    the sub-mesh of the stage that produced them; pass them back in as they
    are. The program is compiled on the first call for each input structure
    and shapes.
    """

    def __init__(
        self,
        fun: Callable,
        *,
        method: PipeshardParallel,
        batch_argnums: Sequence[int],
        devices: Sequence[jax.Device] | None,
    ):
        self._fun, self._method = fun, method
        self._batch_argnums = tuple(batch_argnums)
        self._devices = tuple(devices) if devices is not None else None
        self._executables: dict[Any, PipeshardExecutable] = {}
        self._last_schedule: ExecutedSchedule | None = None
        functools.update_wrapper(self, fun)

    def __call__(self, *args):
        executable = self.get_executable(*args)
        outputs, record = executable(jax.tree.leaves(args))
        self._last_schedule = record
        return jax.tree.unflatten(executable.traced.out_tree, outputs)

    def get_executable(self, *args) -> PipeshardExecutable:
        """The compiled pipeline for arguments like `args` (built if new)."""
        flat, in_tree = jax.tree.flatten(args)
        key = (in_tree, tuple(abstract_leaf(x) for x in flat))
        if key not in self._executables:
            self._executables[key] = self._build(args)
        return self._executables[key]

    def with_runtime_options(self, **changes) -> PipeshardFunction:
        """This function with another schedule or task timing, sharing its compilations.

        Args:
          **changes: `pipeline_schedule` and/or `time_tasks` (see
            `PipeshardParallel`).
        """
        check_runtime_options(changes)
        other = PipeshardFunction(
            self._fun,
            method=dataclasses.replace(self._method, **changes),
            batch_argnums=self._batch_argnums,
            devices=self._devices,
        )
        other._executables = {
            key: exe.with_runtime_options(**changes) for key, exe in self._executables.items()
        }
        return other

    @property
    def last_schedule(self) -> ExecutedSchedule:
        """The tasks the last call ran, in dispatch order, with host times."""
        if self._last_schedule is None:
            raise ValueError("The pipeshard function has not run yet; call it once first.")
        return self._last_schedule

    def plot_schedule(self, path: str | os.PathLike, *, timing: TimelineAxis | str = "clock"):
        """Draws the last call's schedule as a timeline PNG at `path`."""
        plot_schedule(self.last_schedule, path, timing=timing)

    def _build(self, args: tuple) -> PipeshardExecutable:
        method = self._method
        m = method.num_micro_batches
        devices = self._devices or tuple(jax.devices())
        traced = trace_step(self._fun, args, self._batch_argnums, m)
        jaxpr, layers = differentiate(traced, method.layer_option)
        micro_sizes = {
            a.shape[0] for a, split in zip(traced.loss_in_avals, traced.split_inputs) if split
        }
        batch_sizes = frozenset(micro_sizes | {s * m for s in micro_sizes})
        timer = None
        if isinstance(method.stage_option, AutoStageOption):
            timer = stage_timer(
                jaxpr,
                num_layers=layers.num_layers,
                split_inputs=traced.split_inputs,
                concat_outputs=traced.concat_outputs,
                devices=devices,
                batch_sizes=batch_sizes,
                repeats=method.stage_option.profile_repeats,
            )
        plan = construct_stages(
            method.stage_option,
            num_layers=layers.num_layers,
            num_devices=len(devices),
            num_microbatches=m,
            timer=timer,
            virtual_stages=method.virtual_stages,
        )
        program = slice_program(
            jaxpr,
            split_invars=traced.split_inputs,
            stage_of_layer=plan.stage_of_layer,
            concat_outvars=traced.concat_outputs,
        )
        apply_pieces = build_apply_pieces(
            program,
            traced.step,
            num_microbatches=m,
            reduction=method.loss_reduction,
            input_homes=_input_homes(program, traced),
        )
        return PipeshardExecutable(
            traced=traced,
            program=program,
            layers=layers,
            plan=plan,
            meshes=slice_devices(devices, plan),
            apply_pieces=apply_pieces,
            method=method,
            batch_sizes=batch_sizes,
        )


def _input_homes(program, traced) -> dict:
    """Each loss input, and the train-step input feeding it: first stage reading it."""
    homes = {}
    sources = dict(zip(program.jaxpr.jaxpr.invars, traced.step.grad_sources))
    for piece in program.pieces:
        for var in piece.step_inputs:
            homes.setdefault(var, piece.stage)
            if var in sources:
                homes.setdefault(sources[var], piece.stage)
    return homes


def parallelize(
    fun: Callable | None = None,
    *,
    method: PipeshardParallel,
    batch_argnums: Sequence[int] = (1,),
    devices: Sequence[jax.Device] | None = None,
):
    """Runs a train step as a pipeline of data-parallel stages (Alpa-style).

    Supported form: `fun(*args)` takes the pipelined gradient exactly once,
    with `pipeshard.value_and_grad` (or `grad`) called directly in it on a
    loss function whose arguments (and closed-over values) are `fun`'s own
    arguments; everything after the gradient (an optax update, say) may not
    read the batch. Typically:

      @pipeshard.parallelize(method=pipeshard.PipeshardParallel(
          num_micro_batches=4, layer_option="manual", pipeline_schedule="1f1b"))
      def train_step(state, batch):
          loss, grads = pipeshard.value_and_grad(loss_fn)(state.params, batch)
          updates, opt_state = tx.update(grads, state.opt_state, state.params)
          return State(optax.apply_updates(state.params, updates), opt_state), loss

    Args:
      fun: the train step; omit it to use `parallelize` as a decorator.
      method: the pipeline options.
      batch_argnums: arguments split into microbatches along their leading
        axis (every leaf of them).
      devices: the devices to slice into stages; all devices by default.

    Returns:
      A `PipeshardFunction` (or a decorator making one).
    """
    if not isinstance(method, PipeshardParallel):
        raise TypeError(f"parallelize supports method=PipeshardParallel(...), got {method!r}.")
    if fun is None:
        return functools.partial(
            parallelize, method=method, batch_argnums=batch_argnums, devices=devices
        )
    return PipeshardFunction(fun, method=method, batch_argnums=batch_argnums, devices=devices)


class DenseStageFn(Protocol):
    """`(params, activations, batch) -> (loss, (param_grads, activation_grads))`."""

    def __call__(self, params: Any, activations: Any, batch: Any) -> tuple[Any, Any]: ...


def pipeshard_value_and_grad(
    loss_fn: Callable[[Any, Any, Any], Any],
    *,
    method: PipeshardParallel,
    devices: Sequence[jax.Device] | None = None,
) -> DenseStageFn:
    """A dense tower as a pipeshard stage function.

    For use where a step hands the dense part activations computed elsewhere
    (the embedding lookups) and needs back the loss, the dense parameters'
    gradients and the activations' gradients (for the sparse update).

    Args:
      loss_fn: `loss_fn(params, activations, batch) -> float scalar`, with
        pipeline markers (or automatic layers).
      method: the pipeline options.
      devices: the devices to slice into stages.

    Returns:
      `f(params, activations, batch) -> (loss, (param_grads,
      activation_grads))`, equal to `jax.value_and_grad(loss_fn, argnums=(0,
      1))`; `activations` and `batch` are split into microbatches.
    """

    def step(params, activations, batch):
        return value_and_grad(loss_fn, argnums=(0, 1))(params, activations, batch)

    return parallelize(step, method=method, batch_argnums=(1, 2), devices=devices)
