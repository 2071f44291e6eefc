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
n and n+1 take dummy inputs (`get_draining_input`: zeros like a real
batch). At calls 0 and 1 the SC backward stage gets the all-zero placeholder
sparse inputs and zero gradients from `get_initial_state`; it must leave the
tables unchanged for them (plain SGD and Adagrad do; an optimizer that
moves rows on zero gradients can read a validity flag its TC stage puts in
`tc_aux`, which is zero in the placeholder). A value the SC backward stage
needs about its batch, such as the training step for
`embedding.apply_gradients`' learning rate, travels in the batch's sparse
inputs or through `sc_fwd_aux` and `tc_aux`.

A training loop (`jit_step` compiles `step` for the stages and hands on the
state's pass-through leaves outside the program, see its docstring):

    run_step = parallel.jit_step(sc_fwd, tc, sc_bwd)
    state = parallel.get_initial_state(batch(0), train_state, tables, sc_fwd, tc)
    for t in range(parallel.get_pipeline_train_steps(n)):
        valid = parallel.is_output_valid(t, n)
        out, _, train_state, tables, state = run_step(
            batch(t) if t < n else parallel.get_draining_input(state),
            train_state, tables, state,
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

from parallel.sc_tc import _types
from parallel.sc_tc._adapter import unstacked_tc_function
from parallel.sc_tc._drivers import host_driven_step, jit_step
from parallel.sc_tc._state import (
    get_draining_input,
    get_initial_state,
    get_pipeline_state_sharding,
    get_pipeline_train_steps,
    is_output_valid,
)
from parallel.sc_tc._step import step
from parallel.sc_tc._types import *  # noqa: F403 - the stage and state types its __all__ lists

__all__ = [
    *_types.__all__,
    "get_draining_input",
    "get_initial_state",
    "get_pipeline_state_sharding",
    "get_pipeline_train_steps",
    "host_driven_step",
    "is_output_valid",
    "jit_step",
    "step",
    "unstacked_tc_function",
]
