"""Compiling pieces onto their stage's sub-mesh, data-parallel inside it.

Inside a stage, arrays whose leading dimension is a batch size (the
microbatch or the full batch) and divides over the stage's devices are
sharded along it; everything else (parameters, optimizer state,
accumulated gradients) is replicated. The same rule gives producers' output
and consumers' input shardings, so values stay put within a stage and a
transfer between stages is one `jax.device_put`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallel.pipeshard._apply import ApplyPiece, PerMicrobatch, run_ops
from parallel.pipeshard._jaxprs import eval_eqns
from parallel.pipeshard._program import Piece
from parallel.pipeshard._stages import DATA_AXIS

# Cross-device operations in compiled HLO: XLA:CPU must not run two
# programs containing them at once (see `_runtime`).
_COLLECTIVE_OPS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")


class CollectiveProgramInFlight:
    """The outputs of the last dispatched program containing collectives.

    Shared by every pipeshard executable of the process, so that two
    pipeshard functions called in turn also keep to one such program at a
    time. Programs the caller dispatches itself are not tracked: wait for
    them before calling a pipeshard function if they communicate.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._outputs: list = []

    def wait(self) -> float:
        """Blocks until the tracked program finished; returns the seconds waited."""
        began = time.perf_counter()
        with self._lock:
            outputs, self._outputs = self._outputs, []
        # Outputs handed back to the caller may since have been deleted.
        jax.block_until_ready([x for x in outputs if not x.is_deleted()])
        return time.perf_counter() - began

    def track(self, outputs: Any) -> None:
        with self._lock:
            self._outputs = jax.tree.leaves(outputs)


COLLECTIVES_IN_FLIGHT = CollectiveProgramInFlight()


def stage_sharding(shape: Sequence[int], mesh: Mesh, batch_sizes: Collection[int]) -> NamedSharding:
    """Sharding of a value of `shape` on a stage's `mesh` (see module doc)."""
    if shape and shape[0] in batch_sizes and shape[0] % mesh.size == 0:
        return NamedSharding(mesh, PartitionSpec(DATA_AXIS))
    return NamedSharding(mesh, PartitionSpec())


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledProgram:
    """A compiled piece with the shardings its arguments must have.

    Attributes:
      call: the compiled executable.
      in_shardings: pytree of shardings matching the arguments.
      has_collectives: whether the program communicates across devices.
    """

    call: Callable[..., Any]
    in_shardings: Any
    has_collectives: bool


def _compile(fun, in_shardings, out_shardings, abstract_args, donate=()) -> CompiledProgram:
    lowered = jax.jit(
        fun, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=donate
    ).lower(*abstract_args)
    compiled = lowered.compile()
    text = compiled.as_text()
    return CompiledProgram(
        call=compiled,
        in_shardings=in_shardings,
        has_collectives=any(op in text for op in _COLLECTIVE_OPS),
    )


def _abstract(var, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(var.aval.shape, var.aval.dtype, sharding=sharding)


def compile_piece(piece: Piece, mesh: Mesh, batch_sizes: Collection[int]) -> CompiledProgram:
    """Compiles `fun(split, step, transfer, sums) -> (transfer, sums, concat)`.

    `sums` are the running microbatch sums of `piece.sum_outputs`; they are
    donated and returned with this microbatch's values added.
    """
    in_groups = (piece.split_inputs, piece.step_inputs, piece.transfer_inputs, piece.sum_outputs)
    out_groups = (piece.transfer_outputs, piece.sum_outputs, piece.concat_outputs)

    def shardings(group):
        return [stage_sharding(v.aval.shape, mesh, batch_sizes) for v in group]

    def run(split, step, transfer, sums):
        env = dict(zip(piece.split_inputs, split))
        env.update(zip(piece.step_inputs, step))
        env.update(zip(piece.transfer_inputs, transfer))
        eval_eqns(piece.eqns, env)
        return (
            [env[v] for v in piece.transfer_outputs],
            [total + env[v] for total, v in zip(sums, piece.sum_outputs)],
            [env[v] for v in piece.concat_outputs],
        )

    in_shardings = tuple(shardings(g) for g in in_groups)
    abstract = [[_abstract(v, s) for v, s in zip(g, sh)] for g, sh in zip(in_groups, in_shardings)]
    out_shardings = tuple(shardings(g) for g in out_groups)
    return _compile(run, in_shardings, out_shardings, abstract, donate=(3,))


def compile_apply_piece(
    piece: ApplyPiece, mesh: Mesh, batch_sizes: Collection[int], num_microbatches: int
) -> CompiledProgram:
    """Compiles the apply piece `fun(*inputs) -> outputs` on `mesh`."""

    def sharding_of(key):
        var = key.var if isinstance(key, PerMicrobatch) else key
        sharding = stage_sharding(var.aval.shape, mesh, batch_sizes)
        return [sharding] * num_microbatches if isinstance(key, PerMicrobatch) else sharding

    def abstract_of(key, sharding):
        if isinstance(key, PerMicrobatch):
            return [_abstract(key.var, s) for s in sharding]
        return _abstract(key, sharding)

    in_shardings = tuple(sharding_of(k) for k in piece.inputs)
    out_shardings = [sharding_of(v) for v in piece.outputs]
    abstract = [abstract_of(k, s) for k, s in zip(piece.inputs, in_shardings)]
    fun = run_ops(piece.ops, piece.inputs, piece.outputs)
    return _compile(fun, in_shardings, out_shardings, abstract)


def sample_arguments(
    shardings: Sequence[NamedSharding], variables: Sequence[Any], rng: np.random.Generator
) -> list:
    """Arguments for timing a program: uniform(0.5, 1) floats, zero integers."""
    values = []
    for var in variables:
        aval = var.aval
        if np.issubdtype(aval.dtype, np.floating):
            values.append(rng.uniform(0.5, 1.0, aval.shape).astype(aval.dtype))
        else:
            values.append(np.zeros(aval.shape, aval.dtype))
    return jax.device_put(values, list(shardings))
