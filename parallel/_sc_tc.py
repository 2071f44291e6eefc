"""SC/TC step pipelining: the sparse stages of one batch beside the dense stage of another.

One call of `step` runs the SC backward stage (table update) of batch i-2,
then the SC forward stage (lookup) of batch i in the updated tables, and the
TC stage (dense forward and backward) of batch i-1. The TC stage does not
depend on the two sparse stages of the same call, so XLA may run them side
by side. n batches take n + 2 calls:

    step      SC bwd   SC fwd        TC             fake_tc_step
    0         -        0             -              True
    1         -        1             0              False
    t         t-2      t             t-1            False
    n-1       n-3      n-1           n-2            False
    n         n-2      - (dummy)     n-1            False
    n+1       n-1      - (dummy)     -              True

so batch i is looked up in the tables updated with batches 0..i-2 (one
update fewer than in sequential training), and the TC output of batch
`t - 1` comes out of call `t` for `1 <= t <= n` (`is_output_valid`). Calls
n and n+1 take dummy inputs (e.g. zeros like a real batch). At calls 0 and
1 the SC backward stage gets the all-zero placeholder sparse inputs and zero
gradients from `get_initial_state`; it must leave the tables unchanged for
them (plain SGD and Adagrad do; an optimizer that moves rows on zero
gradients can read a validity flag its TC stage puts in `tc_aux`, which is
zero in the placeholder). A value the SC backward stage needs about its
batch, such as the training step for `embedding.apply_gradients`' learning
rate, travels in the batch's sparse inputs or through `sc_fwd_aux` and
`tc_aux`.

A training loop (`jit_step` compiles `step` for the stages and hands on the
state's pass-through leaves outside the program, see its docstring):

    run_step = parallel.jit_step(sc_fwd, tc, sc_bwd)
    state = parallel.get_initial_state(batch(0), train_state, tables, sc_fwd, tc)
    for t in range(parallel.get_pipeline_train_steps(n)):
        valid = parallel.is_output_valid(t, n)
        out, _, train_state, tables, state = run_step(
            batch(t) if t < n else dummy, train_state, tables, state,
            fake_tc_step=not valid)
        if valid:
            log(out)  # batch t - 1

`step` itself is jit-compatible too, with the stage functions and
`fake_tc_step` static: `jax.jit(step, static_argnames=("sc_fwd_function",
"tc_function", "sc_bwd_function", "fake_tc_step"))`, e.g. to put it inside a
larger program.

Recommended ordering. If the SC forward stage returns activations in its
stacked layout (one array per stacked table), unstack them as the first
operation of the TC stage and stack the gradients as its last, so the SC
programs (update then lookup) and the TC program each run as one straight
piece: `unstacked_tc_function` wraps a TC stage written on per-feature
activations. `embedding.sparse_dense_matmul` already returns per-feature
activations and `embedding.apply_gradients` takes per-feature gradients,
so with them the TC stage receives and returns per-feature arrays
(`float32[global_batch, embedding_dim]` by feature) and needs no wrapping.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from parallel._sc_tc_types import (
    AnyPipelineState,
    CurrentStepInput,
    LastStepInput,
    PipelineState,
    ScBwdStageFun,
    ScFwdStageFun,
    StepBeforeLastStepInput,
    TcStageFun,
)

ShardingTree = Any
"""A `jax.sharding.Sharding`, or a pytree prefix of shardings."""

_JIT_HINT = (
    'jax.jit(step, static_argnames=("sc_fwd_function", "tc_function", '
    '"sc_bwd_function", "fake_tc_step"))'
)


class _TcResult(NamedTuple):
    """What the TC stage of one step hands on."""

    embedding_gradients: Any
    output: Any
    train_state: Any
    tc_aux: Any


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
    return pipeline_state_cls(
        pipeline_step=None,
        last_step_inputs=LastStepInput(
            sparse_inputs=sparse_input_sharding,
            embedding_activations=sparse_input_sharding,
            dense_inputs=dense_input_sharding,
            sc_fwd_aux=sc_fwd_aux_sharding,
        ),
        step_before_last_step_inputs=StepBeforeLastStepInput(
            sparse_inputs=sparse_input_sharding,
            embedding_gradients=sparse_input_sharding,
            tc_aux=tc_aux_sharding,
        ),
        placeholder_output=pipeline_output_sharding,
        placeholder_tc_aux=tc_aux_sharding,
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

    Returns:
      The initial `PipelineState` (`pipeline_step` 0).

    Raises:
      TypeError: `pipeline_input` is not a `CurrentStepInput`.
      ValueError: a stage returns the wrong number of values, or the TC stage
        changes the structure of the train state.
    """
    _check_pipeline_input(pipeline_input)
    sparse = _abstract(pipeline_input.sparse_inputs, sparse_input_sharding)
    dense = _abstract(pipeline_input.dense_inputs, dense_input_sharding)
    activations, sc_fwd_aux = jax.eval_shape(
        lambda s, v: _unpack(sc_fwd_function(s, v), "sc_fwd_function", _SC_FWD_OUTPUTS),
        sparse,
        embedding_variables,
    )
    activations = _abstract(activations, sparse_input_sharding)
    sc_fwd_aux = _abstract(sc_fwd_aux, aux_sharding)
    # A host-driven TC stage cannot be traced; it gives a traceable twin for the shapes.
    traceable = getattr(tc_function, "shape_function", tc_function)
    tc = jax.eval_shape(
        lambda *args: _run_tc(traceable, *args), activations, dense, tc_train_state, sc_fwd_aux
    )
    _check_train_state(tc_train_state, tc.train_state)
    state = PipelineState(
        pipeline_step=jax.ShapeDtypeStruct((), jnp.int32),
        last_step_inputs=LastStepInput(
            sparse_inputs=sparse,
            embedding_activations=activations,
            dense_inputs=dense,
            sc_fwd_aux=sc_fwd_aux,
        ),
        step_before_last_step_inputs=StepBeforeLastStepInput(
            sparse_inputs=sparse,
            embedding_gradients=_abstract(tc.embedding_gradients, sparse_input_sharding),
            tc_aux=_abstract(tc.tc_aux, aux_sharding),
        ),
        placeholder_output=_abstract(tc.output, None),
        placeholder_tc_aux=_abstract(tc.tc_aux, aux_sharding),
    )
    return _zeros(state)


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
    return _checked_step(
        _compute,
        pipeline_input,
        tc_train_state,
        embedding_variables,
        pipeline_state,
        (sc_fwd_function, tc_function, sc_bwd_function),
        fake_tc_step,
        gradient_multiplier,
    )


def _checked_step(
    compute: Callable[..., _Computed],
    pipeline_input: CurrentStepInput,
    tc_train_state: Any,
    embedding_variables: Any,
    pipeline_state: AnyPipelineState,
    stages: tuple[ScFwdStageFun, TcStageFun, ScBwdStageFun],
    fake_tc_step: bool,
    gradient_multiplier: jax.typing.ArrayLike | None,
) -> tuple[Any, Any, Any, Any, AnyPipelineState]:
    """One call of `step` with `compute` (`_compute`, jitted or not) doing the arithmetic."""
    _check_call(pipeline_input, pipeline_state, fake_tc_step, gradient_multiplier)
    computed = compute(
        pipeline_input,
        tc_train_state,
        embedding_variables,
        *_split_state(pipeline_state),
        *stages,
        fake_tc_step=fake_tc_step,
        gradient_multiplier=gradient_multiplier,
    )
    return _assemble(computed, pipeline_input, pipeline_state)


def jit_step(
    sc_fwd_function: ScFwdStageFun,
    tc_function: TcStageFun,
    sc_bwd_function: ScBwdStageFun,
    *,
    donate: bool = True,
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

    Returns:
      `run(pipeline_input, tc_train_state, embedding_variables,
      pipeline_state, *, fake_tc_step, gradient_multiplier=None)`, with the
      arguments and results of `step`. One program is compiled per value of
      `fake_tc_step` (and per input shapes).
    """
    compute = jax.jit(
        _compute,
        static_argnames=("sc_fwd_function", "tc_function", "sc_bwd_function", "fake_tc_step"),
        donate_argnames=("tc_train_state", "embedding_variables", "consumed") if donate else (),
    )

    return _runner(compute, (sc_fwd_function, tc_function, sc_bwd_function))


def _runner(compute: Callable[..., _Computed], stages: tuple) -> Callable[..., tuple]:
    """`run(pipeline_input, ..., *, fake_tc_step, gradient_multiplier=None)` over `compute`."""

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
            stages,
            fake_tc_step,
            gradient_multiplier,
        )

    return run


def host_driven_step(
    sc_fwd_function: ScFwdStageFun,
    tc_function: TcStageFun,
    sc_bwd_function: ScBwdStageFun,
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

    Returns:
      `run(pipeline_input, tc_train_state, embedding_variables,
      pipeline_state, *, fake_tc_step)` with the results of `step`; its
      outputs are ready when it returns. A `gradient_multiplier` is
      refused (ValueError): boundary calls skip the TC stage instead.
    """
    sparse = jax.jit(
        _compute,
        static_argnames=("sc_fwd_function", "tc_function", "sc_bwd_function", "fake_tc_step"),
    )

    def compute(pipeline_input, tc_train_state, embedding_variables, consumed, kept, *stages,
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
                *stages,
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

    return _runner(compute, (sc_fwd_function, tc_function, sc_bwd_function))


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


class _Consumed(NamedTuple):
    """The leaves of a pipeline state that a call uses up and replaces."""

    pipeline_step: Any
    embedding_activations: Any
    sc_fwd_aux: Any
    embedding_gradients: Any
    tc_aux: Any


def _split_state(state: PipelineState) -> tuple[_Consumed, PipelineState]:
    """`(consumed, kept)`: `kept` is `state` with the consumed leaves set to None."""
    last, before_last = state.last_step_inputs, state.step_before_last_step_inputs
    consumed = _Consumed(
        state.pipeline_step,
        last.embedding_activations,
        last.sc_fwd_aux,
        before_last.embedding_gradients,
        before_last.tc_aux,
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


def _abstract(tree: Any, sharding: jax.sharding.Sharding | None) -> Any:
    """`ShapeDtypeStruct`s shaped like every leaf of `tree` (arrays or structs).

    With `sharding`, leaves with at least one dimension are placed by it;
    other leaves go to the default device.

    Raises:
      ValueError: `sharding` cannot place a leaf (e.g. its rows do not divide).
    """

    def abstract(leaf):
        shape, dtype = np.shape(leaf), jnp.result_type(leaf)
        if sharding is None or not shape:
            return jax.ShapeDtypeStruct(shape, dtype)
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


def _zeros_like(tree: Any) -> Any:
    return jax.tree.map(jnp.zeros_like, tree)


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
