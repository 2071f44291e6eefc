"""One call of the pipelined step: what it computes and how its outputs are assembled."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from parallel.sc_tc._checks import _check_call
from parallel.sc_tc._stage_calls import _SC_BWD_OUTPUTS, _SC_FWD_OUTPUTS, _tc_stage, _unpack
from parallel.sc_tc._state import (
    _Consumed,
    _merge_state,
    _split_state,
)
from parallel.sc_tc._types import (
    AnyPipelineState,
    CurrentStepInput,
    LastStepInput,
    PipelineState,
    ScBwdStageFun,
    ScFwdStageFun,
    StepBeforeLastStepInput,
    TcStageFun,
)


def step(
    pipeline_input: CurrentStepInput,
    tc_train_state: Any,
    embedding_variables: Any,
    pipeline_state: AnyPipelineState,
    sc_fwd_function: ScFwdStageFun,
    tc_function: TcStageFun,
    sc_bwd_function: ScBwdStageFun,
    *,
    fake_tc_step: bool,
    gradient_multiplier: jax.typing.ArrayLike | None = None,
) -> tuple[Any, Any, Any, Any, AnyPipelineState]:
    """One pipelined step: SC backward of batch i-2, SC forward of batch i, TC of batch i-1.

    Jit-compatible with `sc_fwd_function`, `tc_function`, `sc_bwd_function`
    and `fake_tc_step` static; a fake step does not trace `tc_function` at
    all, so the fill/drain and steady-state steps are two straight-line
    programs (no `lax.cond`).

    Boundary steps either skip the TC stage (`fake_tc_step=True` at calls 0
    and n+1, see `is_output_valid`) or, to keep one program for all calls,
    run it and discard its effect with `gradient_multiplier`: with
    `fake_tc_step=False` and `gradient_multiplier=float(is_output_valid(t, n))`
    the results equal the `fake_tc_step` schedule exactly.

    Args:
      pipeline_input: batch i (`CurrentStepInput`); a dummy shaped like a
        batch at calls n and n+1.
      tc_train_state: the TC train state.
      embedding_variables: the embedding variables.
      pipeline_state: from `get_initial_state` or the previous call.
      sc_fwd_function: the SC forward stage.
      tc_function: the TC stage.
      sc_bwd_function: the SC backward stage.
      fake_tc_step: Python bool; skip the TC stage: the train state passes
        through, the output is the zero placeholder, and the next call's SC
        backward stage gets zero gradients and the zero placeholder aux.
      gradient_multiplier: optional `float32[]`, normally 0 or 1, a traced
        value. Scales the embedding gradients the TC stage hands the next
        call's SC backward stage; where it is 0, the step also keeps the
        train state and hands on the placeholder output and aux, as a fake
        step would. Only with `fake_tc_step=False`.

    Returns:
      `(pipeline_output, sc_bwd_aux, tc_train_state, embedding_variables,
      pipeline_state)`: the TC output of batch i-1 (valid when
      `is_output_valid`), the SC backward aux of batch i-2, and the updated
      states.

    Raises:
      TypeError: `fake_tc_step` is not a Python bool (e.g. not static under
        `jax.jit`), or the inputs are not the pipeline's types.
      ValueError: `gradient_multiplier` is not a scalar or comes with
        `fake_tc_step=True`; a stage returns the wrong number of values.
    """
    compute = functools.partial(
        _compute,
        sc_fwd_function=sc_fwd_function,
        tc_function=tc_function,
        sc_bwd_function=sc_bwd_function,
    )
    return _checked_step(
        compute,
        pipeline_input,
        tc_train_state,
        embedding_variables,
        pipeline_state,
        fake_tc_step,
        gradient_multiplier,
    )


def _checked_step(
    compute: Callable[..., _Computed],
    pipeline_input: CurrentStepInput,
    tc_train_state: Any,
    embedding_variables: Any,
    pipeline_state: AnyPipelineState,
    fake_tc_step: bool,
    gradient_multiplier: jax.typing.ArrayLike | None,
) -> tuple[Any, Any, Any, Any, AnyPipelineState]:
    """One call of `step` with `compute` (`_compute` with its stages bound,
    jitted or not) doing the arithmetic."""
    _check_call(pipeline_input, pipeline_state, fake_tc_step, gradient_multiplier)
    computed = compute(
        pipeline_input,
        tc_train_state,
        embedding_variables,
        *_split_state(pipeline_state),
        fake_tc_step=fake_tc_step,
        gradient_multiplier=gradient_multiplier,
    )
    return _assemble(computed, pipeline_input, pipeline_state)


class _Computed(NamedTuple):
    """What one call computes; the rest of the new state passes through."""

    output: Any
    sc_bwd_aux: Any
    train_state: Any
    embedding_variables: Any
    pipeline_step: jax.Array
    embedding_activations: Any
    sc_fwd_aux: Any
    embedding_gradients: Any
    tc_aux: Any


def _compute(
    pipeline_input: CurrentStepInput,
    tc_train_state: Any,
    embedding_variables: Any,
    consumed: _Consumed,
    kept: PipelineState,
    sc_fwd_function: ScFwdStageFun,
    tc_function: TcStageFun,
    sc_bwd_function: ScBwdStageFun,
    *,
    fake_tc_step: bool,
    gradient_multiplier: jax.typing.ArrayLike | None,
) -> _Computed:
    """What one call computes, from a pipeline state given as `_split_state` parts."""
    pipeline_state = _merge_state(consumed, kept)
    before_last = pipeline_state.step_before_last_step_inputs
    last = pipeline_state.last_step_inputs
    with jax.named_scope("pipelined_sc_bwd"):
        embedding_variables, sc_bwd_aux = _unpack(
            sc_bwd_function(
                before_last.sparse_inputs,
                before_last.embedding_gradients,
                embedding_variables,
                before_last.tc_aux,
            ),
            "sc_bwd_function",
            _SC_BWD_OUTPUTS,
        )
    with jax.named_scope("pipelined_sc_fwd"):
        activations, sc_fwd_aux = _unpack(
            sc_fwd_function(pipeline_input.sparse_inputs, embedding_variables),
            "sc_fwd_function",
            _SC_FWD_OUTPUTS,
        )
    with jax.named_scope("pipelined_tc"):
        tc = _tc_stage(
            last, tc_train_state, pipeline_state, tc_function, fake_tc_step, gradient_multiplier
        )
    return _Computed(
        output=tc.output,
        sc_bwd_aux=sc_bwd_aux,
        train_state=tc.train_state,
        embedding_variables=embedding_variables,
        pipeline_step=pipeline_state.pipeline_step + 1,
        embedding_activations=activations,
        sc_fwd_aux=sc_fwd_aux,
        embedding_gradients=tc.embedding_gradients,
        tc_aux=tc.tc_aux,
    )


def _assemble(
    computed: _Computed, pipeline_input: CurrentStepInput, pipeline_state: PipelineState
) -> tuple[Any, Any, Any, Any, PipelineState]:
    new_state = PipelineState(
        pipeline_step=computed.pipeline_step,
        last_step_inputs=LastStepInput(
            sparse_inputs=pipeline_input.sparse_inputs,
            embedding_activations=computed.embedding_activations,
            dense_inputs=pipeline_input.dense_inputs,
            sc_fwd_aux=computed.sc_fwd_aux,
        ),
        step_before_last_step_inputs=StepBeforeLastStepInput(
            sparse_inputs=pipeline_state.last_step_inputs.sparse_inputs,
            embedding_gradients=computed.embedding_gradients,
            tc_aux=computed.tc_aux,
        ),
        placeholder_output=pipeline_state.placeholder_output,
        placeholder_tc_aux=pipeline_state.placeholder_tc_aux,
    )
    return (
        computed.output,
        computed.sc_bwd_aux,
        computed.train_state,
        computed.embedding_variables,
        new_state,
    )
