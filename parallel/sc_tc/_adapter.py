"""A TC stage written on per-feature activations, adapted to stacked ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from parallel.sc_tc._stage_calls import _run_tc
from parallel.sc_tc._types import (
    TcStageFun,
)


def unstacked_tc_function(
    tc_function: TcStageFun,
    *,
    unstack_activations: Callable[[Any], Any],
    stack_gradients: Callable[[Any], Any],
) -> TcStageFun:
    """A TC stage on stacked activations from one written on per-feature activations.

    The returned stage unstacks the activations as its first operation and
    stacks the gradients as its last, the ordering that lets the SC and TC
    programs overlap. Make it once and pass the same object to every call
    (`jax.jit` keys static functions by identity).

    Args:
      tc_function: a `TcStageFun` whose activations and gradients are per
        feature, e.g. `float32[global_batch, embedding_dim]` by feature.
      unstack_activations: stacked activations -> per-feature activations.
      stack_gradients: per-feature gradients -> stacked gradients (the
        layout of the stacked activations).

    Returns:
      The `TcStageFun` on stacked activations and gradients.
    """

    def stacked_tc_function(embedding_activations, dense_inputs, train_state, sc_fwd_aux=None):
        per_feature = unstack_activations(embedding_activations)
        gradients, output, train_state, tc_aux = _run_tc(
            tc_function, per_feature, dense_inputs, train_state, sc_fwd_aux
        )
        return stack_gradients(gradients), output, train_state, tc_aux

    return stacked_tc_function
