"""Calling the stage functions: their outputs unpacked and checked, the TC stage real or faked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from parallel.sc_tc._checks import _check_train_state
from parallel.sc_tc._types import (
    LastStepInput,
    PipelineState,
    TcStageFun,
)


class _TcResult(NamedTuple):
    """What the TC stage of one step hands on."""

    embedding_gradients: Any
    output: Any
    train_state: Any
    tc_aux: Any


_SC_FWD_OUTPUTS = ("embedding_activations", "sc_fwd_aux")


_SC_BWD_OUTPUTS = ("embedding_variables", "sc_bwd_aux")


def _tc_stage(
    last: LastStepInput,
    train_state: Any,
    pipeline_state: PipelineState,
    tc_function: TcStageFun,
    fake_tc_step: bool,
    gradient_multiplier: jax.typing.ArrayLike | None,
) -> _TcResult:
    """Runs the TC stage of batch i-1, or stands in for it without tracing it."""
    if fake_tc_step:
        return _fake_tc(train_state, pipeline_state)
    real = _run_tc(
        tc_function, last.embedding_activations, last.dense_inputs, train_state, last.sc_fwd_aux
    )
    if gradient_multiplier is None:
        return real
    _check_train_state(train_state, real.train_state)
    multiplier = jnp.asarray(gradient_multiplier, jnp.float32)
    return _discard_where_zero(real, _fake_tc(train_state, pipeline_state), multiplier)


def _fake_tc(train_state: Any, pipeline_state: PipelineState) -> _TcResult:
    """What a step without the TC stage hands on: zeros, and the train state unchanged."""
    # Fresh zeros rather than the state's own placeholders, so no two leaves
    # of the returned state share a buffer (the state is donated next call).
    return _TcResult(
        embedding_gradients=_zeros_like(
            pipeline_state.step_before_last_step_inputs.embedding_gradients
        ),
        output=_zeros_like(pipeline_state.placeholder_output),
        train_state=train_state,
        tc_aux=_zeros_like(pipeline_state.placeholder_tc_aux),
    )


def _discard_where_zero(real: _TcResult, fake: _TcResult, multiplier: jax.Array) -> _TcResult:
    """`real` with its gradients scaled by `multiplier`; `fake` where that is 0.

    Selects rather than multiplies the zero case, so NaNs the TC stage makes
    from placeholder inputs never reach the tables or the train state.
    """
    keep = multiplier != 0

    def select(r, f):
        return jnp.where(keep, r, f)

    def scale(g, f):
        return jnp.where(keep, g * multiplier.astype(g.dtype), f)

    return _TcResult(
        embedding_gradients=jax.tree.map(scale, real.embedding_gradients, fake.embedding_gradients),
        output=jax.tree.map(select, real.output, fake.output),
        train_state=jax.tree.map(select, real.train_state, fake.train_state),
        tc_aux=jax.tree.map(select, real.tc_aux, fake.tc_aux),
    )


def _run_tc(tc_function: TcStageFun, activations, dense_inputs, train_state, sc_fwd_aux):
    result = tc_function(activations, dense_inputs, train_state, sc_fwd_aux)
    return _TcResult(*_unpack(result, "tc_function", _TcResult._fields))


def _unpack(result: Any, stage: str, names: Sequence[str]) -> tuple:
    """`result` as a tuple of `len(names)` values, or a clear error."""
    if not isinstance(result, tuple) or len(result) != len(names):
        got = f"{len(result)} values" if isinstance(result, tuple) else type(result).__name__
        raise ValueError(f"{stage} must return a tuple ({', '.join(names)}), got {got}.")
    return result


def _zeros_like(tree: Any) -> Any:
    return jax.tree.map(jnp.zeros_like, tree)
