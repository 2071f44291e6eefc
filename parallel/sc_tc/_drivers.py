"""The drivers of the step: one compiled program (`jit_step`), or the TC stage from the host."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from parallel.sc_tc._stage_calls import _run_tc
from parallel.sc_tc._state import _merge_state
from parallel.sc_tc._step import _checked_step, _compute, _Computed
from parallel.sc_tc._types import (
    AnyPipelineState,
    CurrentStepInput,
    ScBwdStageFun,
    ScFwdStageFun,
    TcStageFun,
)


def jit_step(
    sc_fwd_function: ScFwdStageFun,
    tc_function: TcStageFun,
    sc_bwd_function: ScBwdStageFun,
    *,
    donate: bool = True,
    compiler_options: dict[str, Any] | None = None,
) -> Callable[..., tuple[Any, Any, Any, Any, AnyPipelineState]]:
    """`step` compiled for the given stages, without copying what it passes on.

    Most of a `PipelineState` passes through a call unchanged: the batch's
    inputs become the last step's, the last step's sparse inputs the step
    before's, the placeholders stay. Under `jax.jit(step)` every such leaf is
    an output of the program, so XLA copies it into a fresh buffer, or, when
    the state is donated, copies it to resolve the buffers' reuse: hundreds
    of small copies per call, which on CPU cost more than a quarter of the
    step. Here only what a call computes runs under `jax.jit`; the
    pass-through leaves are handed on as they are, outside the program.

    What the stages made and the call consumes (the last step's activations
    and SC forward aux, the gradients and TC aux of the step before, the
    step count) is donated, so the results reuse its buffers instead of new
    ones: jax pairs each result with the first unused donated argument of the
    same shape. Where a result takes the buffer of a value the call still
    reads, XLA copies that value first; an aux that the TC stage hands on
    unchanged (e.g. `embedding.LayoutIndex`) is such a copy.

    Args:
      sc_fwd_function: the SC forward stage.
      tc_function: the TC stage.
      sc_bwd_function: the SC backward stage.
      donate: donate the TC train state, the embedding variables and the
        consumed part of the pipeline state (the caller must use the
        returned ones). The batch's inputs are never donated: they move on
        by reference, so a batch may be passed again.
      compiler_options: XLA's options for the step's program (`jax.jit`'s).

    Returns:
      `run(pipeline_input, tc_train_state, embedding_variables,
      pipeline_state, *, fake_tc_step, gradient_multiplier=None)`, with the
      arguments and results of `step`. One program is compiled per value of
      `fake_tc_step` (and per input shapes).
    """
    compute = jax.jit(
        _bound((sc_fwd_function, tc_function, sc_bwd_function)),
        static_argnames=("fake_tc_step",),
        donate_argnames=("tc_train_state", "embedding_variables", "consumed") if donate else (),
        compiler_options=compiler_options,
    )
    return _runner(compute)


def _bound(stages: tuple) -> Callable[..., _Computed]:
    """`_compute` with the stage functions bound, as a function of this step's own.

    Not `_compute` with the stages as static arguments: JAX keeps the programs
    of a module-level function in one cache for the process, keyed by its
    static arguments, so every run's stages (new functions each time) left
    their programs there, and a process that trained many times ran out of
    memory mappings. The programs of this function go with the step.
    """

    def pipelined_step(pipeline_input, tc_train_state, embedding_variables, consumed, kept, *,
                       fake_tc_step, gradient_multiplier):  # fmt: skip
        return _compute(
            pipeline_input,
            tc_train_state,
            embedding_variables,
            consumed,
            kept,
            *stages,
            fake_tc_step=fake_tc_step,
            gradient_multiplier=gradient_multiplier,
        )

    return pipelined_step


def _runner(compute: Callable[..., _Computed]) -> Callable[..., tuple]:
    """`run(pipeline_input, ..., *, fake_tc_step, gradient_multiplier=None)` over
    `compute`, which has the stage functions bound (`_bound`)."""

    def run(
        pipeline_input: CurrentStepInput,
        tc_train_state: Any,
        embedding_variables: Any,
        pipeline_state: AnyPipelineState,
        *,
        fake_tc_step: bool,
        gradient_multiplier: jax.typing.ArrayLike | None = None,
    ) -> tuple[Any, Any, Any, Any, AnyPipelineState]:
        return _checked_step(
            compute,
            pipeline_input,
            tc_train_state,
            embedding_variables,
            pipeline_state,
            fake_tc_step,
            gradient_multiplier,
        )

    return run


def host_driven_step(
    sc_fwd_function: ScFwdStageFun,
    tc_function: TcStageFun,
    sc_bwd_function: ScBwdStageFun,
    *,
    compiler_options: dict[str, Any] | None = None,
) -> Callable[..., tuple[Any, Any, Any, Any, AnyPipelineState]]:
    """`step` for a TC stage driven from the host, e.g. a pipeshard pipeline.

    The sparse stages (update of batch i-2, lookup of batch i) run as one
    compiled program; once it has finished, the host calls `tc_function` on
    batch i-1, which may dispatch programs of its own (a pipeshard pipeline
    runs one per stage and microbatch task). Waiting in between keeps one
    program with collectives in flight at a time, as XLA:CPU needs. Results
    equal `step`'s.

    Args:
      sc_fwd_function: the SC forward stage.
      tc_function: the TC stage, called eagerly.
      sc_bwd_function: the SC backward stage.
      compiler_options: XLA's options for the sparse stages' program
        (`jax.jit`'s); the TC stage compiles its own programs.

    Returns:
      `run(pipeline_input, tc_train_state, embedding_variables,
      pipeline_state, *, fake_tc_step)` with the results of `step`; its
      outputs are ready when it returns. A `gradient_multiplier` is
      refused (ValueError): boundary calls skip the TC stage instead.
    """
    sparse = jax.jit(
        _bound((sc_fwd_function, tc_function, sc_bwd_function)),
        static_argnames=("fake_tc_step",),
        compiler_options=compiler_options,
    )

    def compute(pipeline_input, tc_train_state, embedding_variables, consumed, kept, *,
                fake_tc_step, gradient_multiplier):  # fmt: skip
        if gradient_multiplier is not None:
            raise ValueError(
                "host_driven_step takes no gradient_multiplier: it runs the TC stage from the "
                "host only where it is real; pass fake_tc_step=not is_output_valid(t, n)."
            )
        # The TC stage is left out of the program (fake), then run on the host.
        computed = jax.block_until_ready(
            sparse(
                pipeline_input,
                tc_train_state,
                embedding_variables,
                consumed,
                kept,
                fake_tc_step=True,
                gradient_multiplier=None,
            )
        )
        if fake_tc_step:
            return computed
        last = _merge_state(consumed, kept).last_step_inputs
        tc = jax.block_until_ready(
            _run_tc(
                tc_function,
                last.embedding_activations,
                last.dense_inputs,
                tc_train_state,
                last.sc_fwd_aux,
            )
        )
        return computed._replace(
            output=tc.output,
            train_state=tc.train_state,
            embedding_gradients=tc.embedding_gradients,
            tc_aux=tc.tc_aux,
        )

    return _runner(compute)
