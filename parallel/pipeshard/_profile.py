"""Measuring candidate stages for automatic stage construction."""

from __future__ import annotations

import statistics
import time
from collections.abc import Collection, Sequence

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr
from jax.sharding import Mesh

from parallel.pipeshard._compile import COLLECTIVES_IN_FLIGHT, compile_piece, sample_arguments
from parallel.pipeshard._program import slice_program
from parallel.pipeshard._schedules import TaskKind
from parallel.pipeshard._stages import DATA_AXIS, StageTimer


def stage_timer(
    jaxpr: ClosedJaxpr,
    *,
    num_layers: int,
    split_inputs: Sequence[bool],
    concat_outputs: Sequence[bool],
    devices: Sequence[jax.Device],
    batch_sizes: Collection[int],
    repeats: int,
) -> StageTimer:
    """A timer of `layers first..last` (forward + backward, one microbatch).

    The candidate stage is cut out of the differentiated program exactly as
    the pipeline would cut it, compiled onto the first `num_devices`
    devices, and run on sample inputs; the median of `repeats` runs counts.
    """
    rng = np.random.default_rng(0)

    def timer(first: int, last: int, num_devices: int) -> float:
        # Layers before, inside and after the candidate form up to 3 stages.
        groups = [0 if layer < first else 1 if layer <= last else 2 for layer in range(num_layers)]
        renumber = {g: i for i, g in enumerate(sorted(set(groups)))}
        program = slice_program(
            jaxpr,
            split_invars=split_inputs,
            stage_of_layer=[renumber[g] for g in groups],
            concat_outvars=concat_outputs,
        )
        mesh = Mesh(np.array(devices[:num_devices]), (DATA_AXIS,))
        total = 0.0
        for kind in TaskKind:
            piece = program.piece(renumber[1], kind)
            if piece is not None:
                total += _median_time(piece, mesh, batch_sizes, rng, repeats)
        return total

    return timer


def _median_time(piece, mesh, batch_sizes, rng, repeats: int) -> float:
    compiled = compile_piece(piece, mesh, batch_sizes)
    groups = (piece.split_inputs, piece.step_inputs, piece.transfer_inputs, piece.sum_outputs)
    args = tuple(
        sample_arguments(shardings, list(group), rng)
        for group, shardings in zip(groups, compiled.in_shardings)
    )
    sums = args[3]
    COLLECTIVES_IN_FLIGHT.wait()
    jax.block_until_ready(outputs := compiled.call(*args[:3], sums))  # warm-up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        outputs = compiled.call(*args[:3], outputs[1])
        jax.block_until_ready(outputs)
        times.append(time.perf_counter() - began)
    return statistics.median(times)
