"""The pipeline state: the schedule of calls, the initial zero placeholders, the shardings."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from parallel.sc_tc._checks import _check_num_steps, _check_pipeline_input, _check_train_state
from parallel.sc_tc._stage_calls import _SC_FWD_OUTPUTS, _run_tc, _unpack
from parallel.sc_tc._types import (
    CurrentStepInput,
    LastStepInput,
    PipelineState,
    ScFwdStageFun,
    StepBeforeLastStepInput,
    TcStageFun,
)

ShardingTree = Any
"""A `jax.sharding.Sharding`, or a pytree prefix of shardings."""


def get_pipeline_train_steps(num_steps: int) -> int:
    """The number of `step` calls that train on `num_steps` batches (fill and drain add 2).

    Raises:
      ValueError: `num_steps` is not a positive int.
    """
    _check_num_steps(num_steps)
    return num_steps + 2


def is_output_valid(pipeline_step: int, num_steps: int) -> bool:
    """Whether call `pipeline_step` (0-based) runs the TC stage on a real batch.

    True for `1 <= pipeline_step <= num_steps`: the call's output belongs to
    batch `pipeline_step - 1`. Pass `fake_tc_step=not is_output_valid(...)`.
    """
    return 1 <= pipeline_step <= num_steps


def get_draining_input(state: PipelineState) -> CurrentStepInput:
    """Zeros shaped and placed like the inputs of `state`'s last batch: what calls n and
    n + 1, which drain the pipeline, take instead of a batch.

    One compiled program per placement (`_zeros`): zeros made leaf by leaf
    (`jnp.zeros_like`) were a program each, compiled in every run at its
    first draining call.
    """
    last = state.last_step_inputs
    return _zeros(CurrentStepInput(last.sparse_inputs, last.dense_inputs))


def get_pipeline_state_sharding(
    pipeline_state_cls: Callable[..., PipelineState],
    dense_input_sharding: ShardingTree,
    sparse_input_sharding: ShardingTree,
    pipeline_output_sharding: ShardingTree,
    tc_aux_sharding: ShardingTree,
    *,
    sc_fwd_aux_sharding: ShardingTree | None = None,
) -> PipelineState:
    """The shardings of a `PipelineState`, for `jax.device_put` or `jax.jit`.

    Embedding activations and gradients are sharded like the sparse inputs
    (by batch rows, e.g. `NamedSharding(mesh, P("data"))` on the 1-D mesh of
    `embedding.sparse_dense_matmul`). `pipeline_step` is left to `jax.jit`
    (`None`).

    Args:
      pipeline_state_cls: `PipelineState`, possibly with type parameters.
      dense_input_sharding: of the dense inputs (every leaf, or a prefix).
      sparse_input_sharding: of the sparse inputs, activations and gradients.
      pipeline_output_sharding: of the TC stage's output, e.g. replicated
        `NamedSharding(mesh, P())` for scalar metrics.
      tc_aux_sharding: of the TC stage's aux.
      sc_fwd_aux_sharding: of the SC forward stage's aux; defaults to
        `dense_input_sharding` (give a replicated one for scalar aux).

    Returns:
      A `pipeline_state_cls` whose leaves are shardings (tree prefixes of the
      state).
    """
    if sc_fwd_aux_sharding is None:
        sc_fwd_aux_sharding = dense_input_sharding
    return _placeholder_state(
        pipeline_state_cls,
        None,
        LastStepInput(
            sparse_inputs=sparse_input_sharding,
            embedding_activations=sparse_input_sharding,
            dense_inputs=dense_input_sharding,
            sc_fwd_aux=sc_fwd_aux_sharding,
        ),
        sparse_input_sharding,
        tc_aux_sharding,
        pipeline_output_sharding,
    )


def _placeholder_state(
    pipeline_state_cls: Callable[..., PipelineState],
    pipeline_step: Any,
    last_step_inputs: LastStepInput,
    embedding_gradients: Any,
    tc_aux: Any,
    placeholder_output: Any,
) -> PipelineState:
    """A state as the initial one is laid out: batch i-2 has batch i-1's sparse
    inputs, and the placeholder TC aux is batch i-2's `tc_aux` (the initial
    state and its shardings are built alike, leaf for leaf)."""
    before_last = StepBeforeLastStepInput(
        last_step_inputs.sparse_inputs, embedding_gradients, tc_aux
    )
    return pipeline_state_cls(
        pipeline_step=pipeline_step,
        last_step_inputs=last_step_inputs,
        step_before_last_step_inputs=before_last,
        placeholder_output=placeholder_output,
        placeholder_tc_aux=tc_aux,
    )


def get_initial_state(
    pipeline_input: CurrentStepInput,
    tc_train_state: Any,
    embedding_variables: Any,
    sc_fwd_function: ScFwdStageFun,
    tc_function: TcStageFun,
    dense_input_sharding: jax.sharding.Sharding | None = None,
    sparse_input_sharding: jax.sharding.Sharding | None = None,
    aux_sharding: jax.sharding.Sharding | None = None,
    replicated_sharding: jax.sharding.Sharding | None = None,
) -> PipelineState:
    """The pipeline state before call 0: zeros shaped like what the stages pass on.

    Traces (does not run) `sc_fwd_function` and `tc_function` to learn the
    shapes of activations, gradients, aux values and output; a TC stage that
    cannot be traced (driven from the host, e.g.
    `pipeshard.pipeshard_tc_function`) has a `shape_function` attribute, a
    traceable stage with the same outputs, which is traced instead. Every leaf is a
    buffer of its own, so the state can be donated.

    Args:
      pipeline_input: a batch shaped like every batch the pipeline will get
        (e.g. the first; its values are not used).
      tc_train_state: the TC train state.
      embedding_variables: the embedding variables.
      sc_fwd_function: the SC forward stage.
      tc_function: the TC stage.
      dense_input_sharding: places the dense-input placeholders (leaves with
        at least one dimension); default: the default device.
      sparse_input_sharding: places the sparse-input, activation and gradient
        placeholders the same way.
      aux_sharding: places the SC forward and TC aux placeholders the same
        way. Give it when the aux holds per-batch arrays that the stages
        produce sharded (e.g. `embedding.LayoutIndex`, by rows): a state
        placed otherwise makes every step reshard it.
      replicated_sharding: places the leaves no other sharding places (the
        step number, scalars, the TC stage's output), e.g. `NamedSharding(mesh,
        P())`; default: the default device. The zeros are made where they go:
        copied there from one device by `jax.device_put`, a run of several
        processes of one device each got arrays orbax could not save.

    Returns:
      The initial `PipelineState` (`pipeline_step` 0).

    Raises:
      TypeError: `pipeline_input` is not a `CurrentStepInput`.
      ValueError: a stage returns the wrong number of values, or the TC stage
        changes the structure of the train state.
    """
    _check_pipeline_input(pipeline_input)
    place = functools.partial(_abstract, rest=replicated_sharding)
    sparse = place(pipeline_input.sparse_inputs, sparse_input_sharding)
    dense = place(pipeline_input.dense_inputs, dense_input_sharding)
    activations, sc_fwd_aux = jax.eval_shape(
        lambda s, v: _unpack(sc_fwd_function(s, v), "sc_fwd_function", _SC_FWD_OUTPUTS),
        sparse,
        embedding_variables,
    )
    activations = place(activations, sparse_input_sharding)
    sc_fwd_aux = place(sc_fwd_aux, aux_sharding)
    # A host-driven TC stage cannot be traced; it gives a traceable twin for the shapes.
    traceable = getattr(tc_function, "shape_function", tc_function)
    tc = jax.eval_shape(
        lambda *args: _run_tc(traceable, *args), activations, dense, tc_train_state, sc_fwd_aux
    )
    _check_train_state(tc_train_state, tc.train_state)
    state = _placeholder_state(
        PipelineState,
        jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated_sharding),
        LastStepInput(
            sparse_inputs=sparse,
            embedding_activations=activations,
            dense_inputs=dense,
            sc_fwd_aux=sc_fwd_aux,
        ),
        place(tc.embedding_gradients, sparse_input_sharding),
        place(tc.tc_aux, aux_sharding),
        place(tc.output, None),
    )
    return _zeros(state)


class _Consumed(NamedTuple):
    """The leaves of a pipeline state that a call uses up and replaces.

    Donated, each result takes the buffer of the first unused leaf of its
    shape, in this order (see `jit_step`). The gradients come before the
    activations so that the new activations take the old gradients' buffer,
    which the update before the lookup has read, and the new gradients the
    old activations', which the TC stage read to compute them; in the other
    order each took the buffer of a value its own call still reads, and XLA
    copied both, twice each, in every call.
    """

    pipeline_step: Any
    embedding_gradients: Any
    tc_aux: Any
    embedding_activations: Any
    sc_fwd_aux: Any


def _split_state(state: PipelineState) -> tuple[_Consumed, PipelineState]:
    """`(consumed, kept)`: `kept` is `state` with the consumed leaves set to None."""
    last, before_last = state.last_step_inputs, state.step_before_last_step_inputs
    consumed = _Consumed(
        pipeline_step=state.pipeline_step,
        embedding_gradients=before_last.embedding_gradients,
        tc_aux=before_last.tc_aux,
        embedding_activations=last.embedding_activations,
        sc_fwd_aux=last.sc_fwd_aux,
    )
    kept = state._replace(
        pipeline_step=None,
        last_step_inputs=last._replace(embedding_activations=None, sc_fwd_aux=None),
        step_before_last_step_inputs=before_last._replace(embedding_gradients=None, tc_aux=None),
    )
    return consumed, kept


def _merge_state(consumed: _Consumed, kept: PipelineState) -> PipelineState:
    """The inverse of `_split_state`."""
    last, before_last = kept.last_step_inputs, kept.step_before_last_step_inputs
    return kept._replace(
        pipeline_step=consumed.pipeline_step,
        last_step_inputs=last._replace(
            embedding_activations=consumed.embedding_activations, sc_fwd_aux=consumed.sc_fwd_aux
        ),
        step_before_last_step_inputs=before_last._replace(
            embedding_gradients=consumed.embedding_gradients, tc_aux=consumed.tc_aux
        ),
    )


def _abstract(
    tree: Any, sharding: jax.sharding.Sharding | None, rest: jax.sharding.Sharding | None
) -> Any:
    """`ShapeDtypeStruct`s shaped like every leaf of `tree` (arrays or structs).

    With `sharding`, leaves with at least one dimension are placed by it;
    other leaves by `rest` (None: the default device).

    Raises:
      ValueError: `sharding` cannot place a leaf (e.g. its rows do not divide).
    """

    def abstract(leaf):
        shape, dtype = np.shape(leaf), jnp.result_type(leaf)
        if sharding is None or not shape:
            return jax.ShapeDtypeStruct(shape, dtype, sharding=rest)
        try:
            sharding.shard_shape(shape)
        except ValueError as e:
            raise ValueError(
                f"Cannot place a {dtype}{list(shape)} placeholder with {sharding}: {e}"
            ) from e
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    return jax.tree.map(abstract, tree)


def _zeros(tree: Any) -> Any:
    """Zeros for every `ShapeDtypeStruct` of `tree`, placed as it says, each its own buffer.

    One compiled program per placement: made one by one, the placeholders of
    a pipeline state (dozens for a run of many tables) were a program each,
    looked up and dispatched one after another at every start.
    """
    leaves, treedef = jax.tree.flatten(tree)
    by_placement: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        by_placement.setdefault(leaf.sharding, []).append(i)
    zeros: list[Any] = [None] * len(leaves)
    for sharding, indices in by_placement.items():
        made = _zeros_program(tuple((leaves[i].shape, leaves[i].dtype) for i in indices), sharding)
        for i, array in zip(indices, made(), strict=True):
            zeros[i] = array
    return jax.tree.unflatten(treedef, zeros)


@functools.lru_cache(maxsize=64)
def _zeros_program(shapes: tuple, sharding: jax.sharding.Sharding | None):
    out_shardings = None if sharding is None else (sharding,) * len(shapes)
    return jax.jit(
        lambda: tuple(jnp.zeros(shape, dtype) for shape, dtype in shapes),
        out_shardings=out_shardings,
    )
