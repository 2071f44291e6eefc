"""Checks of the pipelined step's arguments and stages; messages say what to change."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from parallel.sc_tc._types import (
    CurrentStepInput,
    PipelineState,
)

_JIT_HINT = (
    'jax.jit(step, static_argnames=("sc_fwd_function", "tc_function", '
    '"sc_bwd_function", "fake_tc_step"))'
)


def _check_num_steps(num_steps: int) -> None:
    if isinstance(num_steps, bool) or not isinstance(num_steps, int | np.integer) or num_steps < 1:
        raise ValueError(
            f"num_steps must be a positive int (the number of batches), got {num_steps!r}."
        )


def _check_flags(fake_tc_step: Any, gradient_multiplier: Any) -> None:
    if not isinstance(fake_tc_step, bool | np.bool_):
        raise TypeError(
            f"fake_tc_step must be a Python bool, got {type(fake_tc_step).__name__}; "
            f"under jax.jit make it static: {_JIT_HINT}."
        )
    if gradient_multiplier is None:
        return
    if fake_tc_step:
        raise ValueError(
            "gradient_multiplier replaces fake_tc_step at boundary steps; "
            "pass fake_tc_step=False with it (multiplier 0 discards the TC stage's effect)."
        )
    if np.shape(gradient_multiplier) != ():
        raise ValueError(
            f"gradient_multiplier must be a scalar, got shape {np.shape(gradient_multiplier)}."
        )


def _check_call(
    pipeline_input: Any, pipeline_state: Any, fake_tc_step: Any, gradient_multiplier: Any
) -> None:
    _check_flags(fake_tc_step, gradient_multiplier)
    _check_pipeline_input(pipeline_input)
    if not isinstance(pipeline_state, PipelineState):
        raise TypeError(
            f"pipeline_state must be a PipelineState, got {type(pipeline_state).__name__}; "
            "build it with get_initial_state and pass on the one each step returns."
        )


def _check_pipeline_input(pipeline_input: Any) -> None:
    if not isinstance(pipeline_input, CurrentStepInput):
        raise TypeError(
            f"pipeline_input must be a CurrentStepInput(sparse_inputs=..., dense_inputs=...), "
            f"got {type(pipeline_input).__name__}."
        )


def _check_train_state(before: Any, after: Any) -> None:
    if jax.tree.structure(before) != jax.tree.structure(after):
        raise ValueError(
            "tc_function must return a train state with the structure of the one it gets: "
            f"got {jax.tree.structure(after)}, expected {jax.tree.structure(before)}."
        )
