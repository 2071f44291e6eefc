"""The single-controller driver: runs the schedule, then the update.

One Python driver dispatches every task of the schedule in clock order.
Each stage's programs run on the stage's own devices, asynchronously where
the runtime allows it, so stages can overlap while the driver moves on.
Values crossing stages move with `jax.device_put`; microbatch sums stay on
their stage, in donated buffers.

XLA:CPU can deadlock when two programs containing collectives are in
flight at once, and data parallelism inside a stage makes the backward (and
the loss) all-reduce. On CPU the driver therefore waits for the previous
collective program's outputs before dispatching the next one; programs
without collectives still overlap. The wait is recorded per task.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal, Var
from jax.sharding import Mesh

from parallel.pipeshard._apply import ApplyPiece, PerMicrobatch
from parallel.pipeshard._compile import (
    COLLECTIVES_IN_FLIGHT,
    CompiledProgram,
    compile_apply_piece,
    compile_piece,
    stage_sharding,
)
from parallel.pipeshard._layers import LayerAssignment
from parallel.pipeshard._options import PipelineSchedule, PipeshardParallel
from parallel.pipeshard._program import MicrobatchProgram, split_weight_gradients
from parallel.pipeshard._schedules import (
    ExecutedSchedule,
    Task,
    TaskKind,
    TaskRecord,
    build_schedule,
)
from parallel.pipeshard._stages import StagePlan
from parallel.pipeshard._tracing import TracedStep

logger = logging.getLogger(__name__)


@functools.partial(jax.jit, static_argnums=1)
def _cut_program(values: list[jax.Array], m: int) -> list[list[jax.Array]]:
    """`values[i]: [batch, ...]` -> `m` arrays `[batch / m, ...]` each."""
    return [jnp.split(value, m) for value in values]


def check_runtime_options(changes: dict[str, Any]) -> None:
    """Rejects options that would need recompiling."""
    unknown = set(changes) - {"pipeline_schedule", "time_tasks"}
    if unknown:
        raise ValueError(
            f"Only pipeline_schedule and time_tasks can change without recompiling; got "
            f"{sorted(unknown)}. Call parallelize again for other options."
        )


@dataclasses.dataclass
class _StepState:
    """Values of one call: per-microbatch environments and sums."""

    step_values: dict[tuple[int, Var], Any]
    split_values: dict[tuple[int, Var], list]
    microbatch_env: list[dict[Var, Any]]
    pending_reads: list[dict[Var, int]]
    sums: dict[Var, Any]
    concats: dict[Var, list]
    start: float
    records: list[TaskRecord] = dataclasses.field(default_factory=list)


class PipeshardExecutable:
    """A train step compiled into per-stage programs and a schedule.

    Attributes:
      layers: the layer of every forward equation.
      plan: the layers and device count of every stage.
      meshes: the sub-mesh of every stage.
      program: the per-microbatch pieces.
      apply_pieces: the once-per-step programs.
      clocks: the schedule that every call runs.
    """

    def __init__(
        self,
        *,
        traced: TracedStep,
        program: MicrobatchProgram,
        layers: LayerAssignment,
        plan: StagePlan,
        meshes: Sequence[Mesh],
        apply_pieces: Sequence[ApplyPiece],
        method: PipeshardParallel,
        batch_sizes: frozenset[int],
    ):
        self.traced, self.layers, self.plan = traced, layers, plan
        self.meshes, self.apply_pieces, self.method = tuple(meshes), tuple(apply_pieces), method
        self._batch_sizes = batch_sizes
        self._programs = {False: program}
        self._compiled: dict[tuple[int, TaskKind, bool], CompiledProgram] = {}
        m = method.num_micro_batches
        self._apply = [
            (a, compile_apply_piece(a, self.meshes[a.stage], batch_sizes, m)) for a in apply_pieces
        ]
        self._serialize_collectives = any(
            d.platform == "cpu" for mesh in meshes for d in mesh.devices.flat
        )
        self._sources = dict(zip(program.jaxpr.jaxpr.invars, traced.step.grad_sources))
        self._consts = dict(zip(program.jaxpr.jaxpr.constvars, program.jaxpr.consts))
        self._configure()
        logger.info(
            "Pipeshard: %d layers in %d stages %s on %s devices, %d apply programs.",
            layers.num_layers,
            plan.num_stages,
            plan.stage_layer_ids,
            plan.device_counts,
            len(self._apply),
        )

    def with_runtime_options(self, **changes) -> PipeshardExecutable:
        """The same compiled programs run with other runtime options.

        Args:
          **changes: new values of `PipeshardParallel.pipeline_schedule`
            and/or `time_tasks`, the options that do not change how the
            model is cut. Going to or from "zero_bubble" compiles the split
            backward pieces (or the whole ones) once.
        """
        check_runtime_options(changes)
        other = copy.copy(self)
        other.method = dataclasses.replace(self.method, **changes)
        other._configure()
        return other

    def _configure(self) -> None:
        """The schedule, and the pieces it runs (backwards split for zero bubble)."""
        method, plan = self.method, self.plan
        split = method.pipeline_schedule is PipelineSchedule.ZERO_BUBBLE
        if split not in self._programs:
            self._programs[split] = split_weight_gradients(self._programs[False])
        self.program = self._programs[split]
        self.clocks = build_schedule(
            method.pipeline_schedule,
            method.num_micro_batches,
            plan.num_groups,
            plan.virtual_stages,
        )
        self._pieces = {}
        for p in self.program.pieces:
            key = (p.stage, p.kind, split and p.kind is not TaskKind.FORWARD)
            if key not in self._compiled:
                self._compiled[key] = compile_piece(p, self.meshes[p.stage], self._batch_sizes)
            self._pieces[(p.stage, p.kind)] = (p, self._compiled[key])
        self._readers = self._transfer_readers()
        self._plan_inputs()

    def _transfer_readers(self) -> dict[Var, int]:
        readers: dict[Var, int] = {}
        for piece in self.program.pieces:
            for v in piece.transfer_inputs:
                readers[v] = readers.get(v, 0) + 1
        return readers

    def __call__(self, flat_args: Sequence[Any]) -> tuple[list, ExecutedSchedule]:
        """Runs one step on the flat arguments; returns flat outputs and the record."""
        outer = self._outer_env(flat_args)
        state = self._start(outer)
        for clock, tasks in enumerate(self.clocks):
            for task in tasks:
                self._run_task(task, clock, state)
        outputs = self._apply_phase(outer, state)
        record = ExecutedSchedule(
            schedule=self.method.pipeline_schedule,
            num_stages=self.plan.num_groups,
            num_microbatches=self.method.num_micro_batches,
            records=tuple(state.records),
            virtual_stages=self.plan.virtual_stages,
        )
        return outputs, record

    def _outer_env(self, flat_args) -> dict[Var, Any]:
        jaxpr = self.traced.step.jaxpr
        env = dict(zip(jaxpr.jaxpr.invars, flat_args))
        env.update(zip(jaxpr.jaxpr.constvars, jaxpr.consts))
        return env

    def _loss_input(self, var: Var, outer: dict[Var, Any]) -> Any:
        if var in self._consts:
            return self._consts[var]
        source = self._sources[var]
        return source.val if isinstance(source, Literal) else outer[source]

    def _sharding(self, var: Var, stage: int):
        return stage_sharding(var.aval.shape, self.meshes[stage], self._batch_sizes)

    def _plan_inputs(self) -> None:
        """The static part of every step's input placement, computed once."""
        pieces = self.program.pieces
        self._step_keys = list(dict.fromkeys((p.stage, v) for p in pieces for v in p.step_inputs))
        self._split_keys = list(dict.fromkeys((p.stage, v) for p in pieces for v in p.split_inputs))
        self._sum_vars = [(p.stage, v) for p in pieces for v in p.sum_outputs]
        m = self.method.num_micro_batches
        self._placement = [self._sharding(v, s) for s, v in self._step_keys]
        self._placement += [self._sharding(v, s) for s, v in self._split_keys for _ in range(m)]
        self._placement += [self._sharding(v, s) for s, v in self._sum_vars]
        producer_stage = {v: p.stage for p in pieces for v in p.transfer_outputs}
        self._crossing = {
            (p.stage, p.kind): [producer_stage[v] != p.stage for v in p.transfer_inputs]
            for p in pieces
        }

    def _start(self, outer: dict[Var, Any]) -> _StepState:
        """Places the step's inputs, microbatches and zero sums with one transfer."""
        start = time.perf_counter()
        m = self.method.num_micro_batches
        values = [self._loss_input(v, outer) for _, v in self._step_keys]
        values += self._cut_into_microbatches(
            [self._loss_input(v, outer) for _, v in self._split_keys]
        )
        values += [np.zeros(v.aval.shape, v.aval.dtype) for _, v in self._sum_vars]
        placed = iter(jax.device_put(values, self._placement))
        step_values = {key: next(placed) for key in self._step_keys}
        split_values = {key: [next(placed) for _ in range(m)] for key in self._split_keys}
        sums = {v: next(placed) for _, v in self._sum_vars}
        return _StepState(
            step_values=step_values,
            split_values=split_values,
            microbatch_env=[{} for _ in range(m)],
            pending_reads=[dict(self._readers) for _ in range(m)],
            sums=sums,
            concats={v: [None] * m for p in self.program.pieces for v in p.concat_outputs},
            start=start,
        )

    def _cut_into_microbatches(self, values: Sequence[Any]) -> list:
        """The `m` microbatches of each value (leading axis), flat in order.

        Cutting an array sharded over several devices moves rows between
        them: a program with collectives. Indexing would dispatch one per
        microbatch, all in flight at once, which XLA:CPU can deadlock on; so
        the arrays of one device set are cut by a single program, run in turn
        with the other collective programs. Other values are cut in place.
        """
        m = self.method.num_micro_batches
        pieces: list[Any] = [None] * len(values)
        by_devices: dict[frozenset, list[int]] = {}
        for i, value in enumerate(values):
            if isinstance(value, jax.Array) and len(value.sharding.device_set) > 1:
                by_devices.setdefault(frozenset(value.sharding.device_set), []).append(i)
            else:
                value = value if isinstance(value, jax.Array) else np.asarray(value)
                size = value.shape[0] // m
                pieces[i] = [value[k * size : (k + 1) * size] for k in range(m)]
        for indices in by_devices.values():
            self._wait_for_collectives(True)
            cut = _cut_program([values[i] for i in indices], m)
            self._dispatched(True, cut)
            for i, microbatches in zip(indices, cut, strict=True):
                pieces[i] = microbatches
        return [microbatch for microbatches in pieces for microbatch in microbatches]

    def _wait_for_collectives(self, has_collectives: bool) -> float:
        if not (self._serialize_collectives and has_collectives):
            return 0.0
        return COLLECTIVES_IN_FLIGHT.wait()

    def _dispatched(self, has_collectives: bool, outputs: Any) -> None:
        if self._serialize_collectives and has_collectives:
            COLLECTIVES_IN_FLIGHT.track(outputs)

    def _run_task(self, task: Task, clock: int, state: _StepState) -> None:
        began = time.perf_counter()
        entry = self._pieces.get((task.stage, task.kind))
        wait, launched, launch, outputs = 0.0, began, 0.0, None
        if entry is not None:
            piece, program = entry
            k, env = task.microbatch, state.microbatch_env[task.microbatch]
            transfer = self._transfer_inputs(piece, program, env)
            args = (
                [state.split_values[(task.stage, v)][k] for v in piece.split_inputs],
                [state.step_values[(task.stage, v)] for v in piece.step_inputs],
                transfer,
                [state.sums[v] for v in piece.sum_outputs],
            )
            wait = self._wait_for_collectives(program.has_collectives)
            launched = time.perf_counter()
            outputs = program.call(*args)
            launch = time.perf_counter() - launched
            self._dispatched(program.has_collectives, outputs)
            transfer_out, sums, concat = outputs
            env.update(zip(piece.transfer_outputs, transfer_out))
            state.sums.update(zip(piece.sum_outputs, sums))
            for v, value in zip(piece.concat_outputs, concat):
                state.concats[v][k] = value
            self._release(piece.transfer_inputs, env, state.pending_reads[k])
        dispatched = time.perf_counter()
        finish = None
        if self.method.time_tasks and outputs is not None:
            jax.block_until_ready(outputs)
            finish = time.perf_counter() - state.start
        state.records.append(
            TaskRecord(
                task=task,
                clock=clock,
                dispatch_start=began - state.start,
                dispatch_end=dispatched - state.start,
                wait=wait,
                launch_start=launched - state.start,
                launch=launch,
                finish=finish,
            )
        )

    def _transfer_inputs(self, piece, program: CompiledProgram, env: dict) -> list:
        """The piece's inputs from earlier pieces, moved to its stage if elsewhere."""
        values = [env[v] for v in piece.transfer_inputs]
        crossing = self._crossing[(piece.stage, piece.kind)]
        moving = [i for i, c in enumerate(crossing) if c]
        if moving:
            moved = jax.device_put(
                [values[i] for i in moving], [program.in_shardings[2][i] for i in moving]
            )
            for i, value in zip(moving, moved):
                values[i] = value
        return values

    @staticmethod
    def _release(read: Sequence[Var], env: dict, pending: dict[Var, int]) -> None:
        """Drops a microbatch's values once their last reader has run."""
        for v in read:
            pending[v] -= 1
            if pending[v] == 0:
                env.pop(v, None)

    def _apply_phase(self, outer: dict[Var, Any], state: _StepState) -> list:
        env: dict[Any, Any] = dict(outer)
        env.update((v, self._loss_input(v, outer)) for v in self.program.jaxpr.jaxpr.invars)
        env.update(self._consts)
        env.update(state.sums)
        env.update((PerMicrobatch(v), values) for v, values in state.concats.items())
        for piece, program in self._apply:
            args = jax.device_put([env[k] for k in piece.inputs], list(program.in_shardings))
            self._wait_for_collectives(program.has_collectives)
            outputs = program.call(*args)
            self._dispatched(program.has_collectives, outputs)
            env.update(zip(piece.outputs, outputs))
        return [
            v.val if isinstance(v, Literal) else env[v]
            for v in self.traced.step.jaxpr.jaxpr.outvars
        ]
