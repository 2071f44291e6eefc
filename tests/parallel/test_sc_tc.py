"""SC/TC step pipelining: the schedule, aux routing, boundary steps, and equivalence
with sequential training whose embedding updates are delayed like the pipeline's.

The stage functions are small stand-ins with the stage contracts: a sum of
gathered table rows (SC forward), an SGD scatter-add update (SC backward) and
a two-layer MLP trained with optax (TC).
"""

import functools
import gc
import weakref

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import parallel
from parallel import (
    CurrentStepInput,
    PipelineState,
    get_initial_state,
    get_pipeline_state_sharding,
    get_pipeline_train_steps,
    is_output_valid,
    step,
    unstacked_tc_function,
)

STATIC = ("sc_fwd_function", "tc_function", "sc_bwd_function", "fake_tc_step")
DONATED = ("tc_train_state", "embedding_variables", "pipeline_state")

# ---------------------------------------------------------------------------
# Schedule probes: batch b carries the tag b + 1 in its sparse and dense
# inputs, so 0 marks a placeholder from get_initial_state and -1 a dummy.

NONE, DUMMY = 0, -1


def probe_sc_fwd(sparse, variables):
    return sparse["tag"], {"fwd": 10 * sparse["tag"]}


def probe_tc(activations, dense, runs, sc_fwd_aux=None):
    output = {"act": activations, "dense": dense["tag"], "fwd_aux": sc_fwd_aux["fwd"]}
    return activations, output, runs + 1, {"tc": 100 * dense["tag"]}


def probe_sc_bwd(sparse, gradients, variables, tc_aux=None):
    return variables, {"sparse": sparse["tag"], "grads": gradients, "tc_aux": tc_aux["tc"]}


def probe_batch(tag):
    tag = np.int32(tag)
    return CurrentStepInput(sparse_inputs={"tag": tag}, dense_inputs={"tag": tag})


def run_probes(n, step_fn):
    """Per call: (tag seen by SC fwd, TC output, SC bwd aux), and the final TC run count."""
    runs, variables = np.int32(0), np.float32(0)
    state = get_initial_state(probe_batch(1), runs, variables, probe_sc_fwd, probe_tc)
    seen = []
    for t in range(get_pipeline_train_steps(n)):
        batch = probe_batch(t + 1 if t < n else DUMMY)
        out, bwd_aux, runs, variables, state = step_fn(
            batch, runs, variables, state, probe_sc_fwd, probe_tc, probe_sc_bwd,
            fake_tc_step=not is_output_valid(t, n),
        )  # fmt: skip
        fwd = int(state.last_step_inputs.sc_fwd_aux["fwd"]) // 10
        seen.append((fwd, jax.tree.map(int, out), jax.tree.map(int, bwd_aux)))
    return seen, int(runs), int(state.pipeline_step)


def reference_table(n):
    """The reference's schedule: per call t, the batch of (SC fwd, TC, SC bwd); None for '-'."""
    rows = []
    for t in range(n + 2):
        sc_fwd = t if t < n else "dummy"
        tc = t - 1 if 1 <= t <= n else None
        sc_bwd = t - 2 if t >= 2 else None
        rows.append((sc_fwd, tc, sc_bwd))
    return rows


def as_batches(seen):
    """The observed tags as batch indices, in the reference table's terms."""

    def batch(tag):
        return {NONE: None, DUMMY: "dummy"}.get(tag, tag - 1)

    return [(batch(fwd), batch(out["dense"]), batch(bwd["sparse"])) for fwd, out, bwd in seen]


def test_reference_table_for_four_batches():
    # The reference's table written out for n = 4 (E: extra steps).
    assert reference_table(4) == [
        (0, None, None),
        (1, 0, None),
        (2, 1, 0),
        (3, 2, 1),
        ("dummy", 3, 2),  # E
        ("dummy", None, 3),  # E
    ]


STEP_FNS = {"eager": step, "jit": jax.jit(step, static_argnames=STATIC)}


@pytest.mark.parametrize("mode", sorted(STEP_FNS))
@pytest.mark.parametrize("n", [1, 2, 4, 7])
def test_each_stage_sees_the_reference_batch_at_each_call(n, mode):
    seen, tc_runs, pipeline_step = run_probes(n, STEP_FNS[mode])
    assert as_batches(seen) == reference_table(n)
    assert tc_runs == n
    assert pipeline_step == n + 2


@pytest.mark.parametrize("mode", sorted(STEP_FNS))
def test_aux_reaches_the_next_stage_one_call_later(mode):
    n = 5
    seen, _, _ = run_probes(n, STEP_FNS[mode])
    for t in range(1, n + 2):
        fwd_before, _, _ = seen[t - 1]
        _, out, bwd = seen[t]
        if is_output_valid(t, n):
            # sc_fwd_aux of call t - 1 (10 * tag) reaches the TC stage at call t,
            # together with that batch's activations and dense inputs.
            assert out["fwd_aux"] == 10 * fwd_before
            assert out["act"] == out["dense"] == fwd_before
        else:
            assert out == {"act": NONE, "dense": NONE, "fwd_aux": NONE}
        if t >= 2:
            # tc_aux of call t - 1 (100 * tag) reaches the SC backward stage at
            # call t with that batch's gradients; its aux is returned by step.
            _, out_before, _ = seen[t - 1]
            assert bwd == {
                "sparse": out_before["dense"],
                "grads": out_before["act"],
                "tc_aux": 100 * out_before["dense"],
            }
    # Calls 0 and 1 update with the zero placeholders.
    assert [seen[t][2] for t in (0, 1)] == [{"sparse": 0, "grads": 0, "tc_aux": 0}] * 2


@pytest.mark.parametrize("n", [1, 2, 5])
def test_output_is_valid_exactly_for_calls_1_to_n(n):
    calls = get_pipeline_train_steps(n)
    assert calls == n + 2
    assert [is_output_valid(t, n) for t in range(calls)] == [False] + [True] * n + [False]


@pytest.mark.parametrize("num_steps", [0, -3, 2.0, True])
def test_pipeline_train_steps_rejects_bad_counts(num_steps):
    with pytest.raises(ValueError, match="num_steps must be a positive int"):
        get_pipeline_train_steps(num_steps)


# ---------------------------------------------------------------------------
# Training stand-ins.

ROWS, DIM, BATCH, VALENCY, DENSE = 16, 4, 8, 2, 3
SPARSE_LR = 2.0
DENSE_OPTIMIZER = optax.adam(0.05)


def lookup(sparse, table):
    """SC forward: `float32[BATCH, DIM]`, the sum of each sample's rows."""
    return table[sparse["ids"]].sum(axis=1), None


def sgd_update(sparse, gradients, table, tc_aux=None):
    """SC backward: SGD on the rows each sample looked up (scatter-add)."""
    ids = sparse["ids"]
    row_grads = jnp.broadcast_to(gradients[:, None, :], (*ids.shape, DIM))
    update = -SPARSE_LR * row_grads.reshape(-1, DIM)
    return jnp.asarray(table).at[ids.reshape(-1)].add(update), None


def mlp_loss(params, activations, dense):
    features = jnp.concatenate([activations, dense["x"]], axis=1)
    hidden = jnp.tanh(features @ params["w1"] + params["b1"])
    prediction = (hidden @ params["w2"] + params["b2"])[:, 0]
    return jnp.mean((prediction - dense["y"]) ** 2)


def dense_train(activations, dense, train_state, sc_fwd_aux=None):
    """TC: MLP forward/backward and an Adam update; gradients w.r.t. the activations."""
    params, opt_state = train_state
    loss, (param_grads, act_grads) = jax.value_and_grad(mlp_loss, argnums=(0, 1))(
        params, activations, dense
    )
    updates, opt_state = DENSE_OPTIMIZER.update(param_grads, opt_state, params)
    return act_grads, {"loss": loss}, (optax.apply_updates(params, updates), opt_state), None


def make_problem(num_batches, seed=0):
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(ROWS, DIM)).astype(np.float32)
    params = {
        "w1": rng.normal(size=(DIM + DENSE, 8)).astype(np.float32),
        # Non-zero biases: the TC stage then has non-zero gradients even on
        # all-zero placeholder inputs, so boundary steps must really be skipped.
        "b1": rng.normal(size=(8,)).astype(np.float32),
        "w2": rng.normal(size=(8, 1)).astype(np.float32),
        "b2": rng.normal(size=(1,)).astype(np.float32),
    }
    batches = [
        CurrentStepInput(
            sparse_inputs={"ids": rng.integers(0, ROWS, (BATCH, VALENCY), dtype=np.int32)},
            dense_inputs={
                "x": rng.normal(size=(BATCH, DENSE)).astype(np.float32),
                "y": rng.normal(size=(BATCH,)).astype(np.float32),
            },
        )
        for _ in range(num_batches)
    ]
    return table, (params, DENSE_OPTIMIZER.init(params)), batches


STAGES = {"eager": (lookup, dense_train, sgd_update)}
# Compiled one by one, the stages round exactly as inside the jitted step;
# eager and compiled float32 results differ by a few ulps, which training
# amplifies.
STAGES["jit"] = tuple(jax.jit(stage) for stage in STAGES["eager"])


def train_sequential(table, train_state, batches, *, delay, mode="eager"):
    """Training one batch at a time; batch i's lookup sees the updates of batches <= i - delay."""
    sc_fwd, tc, sc_bwd = STAGES[mode]
    pending, losses = [], []
    for batch in batches:
        while len(pending) >= delay:
            table, _ = sc_bwd(*pending.pop(0), table)
        activations, _ = sc_fwd(batch.sparse_inputs, table)
        grads, out, train_state, _ = tc(activations, batch.dense_inputs, train_state)
        pending.append((batch.sparse_inputs, grads))
        losses.append(out["loss"])
    for sparse, grads in pending:
        table, _ = sc_bwd(sparse, grads, table)
    return table, train_state, losses


def train_pipelined(
    table, train_state, batches, step_fn, *, multiplier=False, dummy=None,
    stages=(lookup, dense_train, sgd_update),
):  # fmt: skip
    n = len(batches)
    if dummy is None:
        dummy = jax.tree.map(jnp.zeros_like, batches[0])
    state = get_initial_state(batches[0], train_state, table, lookup, dense_train)
    losses = []
    for t in range(get_pipeline_train_steps(n)):
        valid = is_output_valid(t, n)
        if multiplier:
            boundary = {"fake_tc_step": False, "gradient_multiplier": jnp.float32(valid)}
        else:
            boundary = {"fake_tc_step": not valid}
        out, _, train_state, table, state = step_fn(
            batches[t] if t < n else dummy, train_state, table, state, *stages, **boundary,
        )  # fmt: skip
        if valid:
            losses.append(out["loss"])
    return table, train_state, losses


def assert_same_training(got, expected, rtol=1e-6, atol=1e-7):
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=rtol, atol=atol)


def jit_step(donate):
    return jax.jit(step, static_argnames=STATIC, donate_argnames=DONATED if donate else ())


@pytest.mark.parametrize("multiplier", [False, True], ids=["fake_tc_step", "multiplier"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_pipelined_training_equals_sequential_training_with_delayed_updates(mode, multiplier):
    table, train_state, batches = make_problem(12)
    expected = train_sequential(table, train_state, batches, delay=2, mode=mode)
    step_fn = step if mode == "eager" else jit_step(donate=True)
    got = train_pipelined(table, train_state, batches, step_fn, multiplier=multiplier)
    # Compiled with the multiplier's selects, the TC stage fuses differently and
    # rounds a few ulps apart, which twelve steps of training amplify.
    assert_same_training(got, expected, atol=1e-6 if multiplier and mode == "jit" else 1e-7)
    assert int(got[1][1][0].count) == len(batches)  # Adam stepped once per real batch


def test_the_delay_is_observable():
    # Guards the equivalence test: training without the delay ends elsewhere.
    table, train_state, batches = make_problem(12)
    delayed = train_sequential(table, train_state, batches, delay=2)
    immediate = train_sequential(table, train_state, batches, delay=1)
    assert not np.allclose(delayed[0], immediate[0], rtol=1e-3)


def test_boundary_tc_steps_would_change_training_without_the_multiplier():
    # Guards the multiplier test: running the TC stage on placeholders and
    # dummies for real corrupts the tables and the dense state.
    table, train_state, batches = make_problem(4)
    skipped = train_pipelined(table, train_state, batches, step)
    n = len(batches)
    state = get_initial_state(batches[0], train_state, table, lookup, dense_train)
    dummy = jax.tree.map(jnp.zeros_like, batches[0])
    for t in range(get_pipeline_train_steps(n)):
        _, _, train_state, table, state = step(
            batches[t] if t < n else dummy, train_state, table, state,
            lookup, dense_train, sgd_update, fake_tc_step=False,
        )  # fmt: skip
    assert not np.allclose(skipped[0], table, rtol=1e-3)
    assert int(train_state[1][0].count) == n + 2


def test_multiplier_boundary_steps_equal_fake_steps_bitwise():
    table, train_state, batches = make_problem(5)
    fake = train_pipelined(table, train_state, batches, step)
    multiplied = train_pipelined(table, train_state, batches, step, multiplier=True)
    for f, m in zip(jax.tree.leaves(fake), jax.tree.leaves(multiplied), strict=True):
        np.testing.assert_array_equal(np.asarray(f), np.asarray(m))


def test_jitted_step_runs_thirty_calls_back_to_back_with_two_programs():
    traces = []

    def counting_train(*args):
        traces.append(None)
        return dense_train(*args)

    table, train_state, batches = make_problem(28)
    expected = train_sequential(table, train_state, batches, delay=2, mode="jit")
    n = len(batches)
    step_fn = jit_step(donate=True)
    state = get_initial_state(batches[0], train_state, table, lookup, counting_train)
    traced_by_init = len(traces)
    # One dummy object for both drain calls, as the reference's loop does.
    dummy = jax.tree.map(jnp.zeros_like, batches[0])
    losses = []
    for t in range(get_pipeline_train_steps(n)):
        donated = (table, state)
        out, _, train_state, table, state = step_fn(
            batches[t] if t < n else dummy, train_state, table, state,
            lookup, counting_train, sgd_update, fake_tc_step=not is_output_valid(t, n),
        )  # fmt: skip
        if is_output_valid(t, n):
            losses.append(out["loss"])
        if is_output_valid(t, n):  # (a fake step leaves its unused inputs alone)
            assert all(leaf.is_deleted() for leaf in jax.tree.leaves(donated))
    assert len(traces) - traced_by_init == 1  # only the steady-state program traces TC
    assert_same_training((table, train_state, losses), expected)


def test_multiplier_keeps_one_program_for_every_call():
    traces = []

    def counting_train(*args):
        traces.append(None)
        return dense_train(*args)

    table, train_state, batches = make_problem(6)
    n = len(batches)
    step_fn = jit_step(donate=False)
    state = get_initial_state(batches[0], train_state, table, lookup, counting_train)
    before = len(traces)
    dummy = jax.tree.map(jnp.zeros_like, batches[0])
    for t in range(get_pipeline_train_steps(n)):
        _, _, train_state, table, state = step_fn(
            batches[t] if t < n else dummy, train_state, table, state,
            lookup, counting_train, sgd_update,
            fake_tc_step=False, gradient_multiplier=jnp.float32(is_output_valid(t, n)),
        )  # fmt: skip
    assert len(traces) - before == 1


def checked_jit_step():
    """`parallel.jit_step` for the test stages, checking what each call donates and passes on."""
    run = parallel.jit_step(lookup, dense_train, sgd_update)

    def checked(batch, train_state, table, state, **boundary):
        result = run(batch, train_state, table, state, **boundary)
        last, before_last = state.last_step_inputs, state.step_before_last_step_inputs
        # What the stages made is used up and donated...
        consumed = [last.embedding_activations, before_last.embedding_gradients]
        # ...what passes on (inputs, placeholders) is not.
        passed = [last.sparse_inputs, state.placeholder_output, state.placeholder_tc_aux]
        if not boundary.get("fake_tc_step"):  # (a fake step leaves its unused inputs alone)
            assert table.is_deleted()
            consumed_leaves = jax.tree.leaves(consumed)
            assert consumed_leaves and all(leaf.is_deleted() for leaf in consumed_leaves)
        arrays = [leaf for leaf in jax.tree.leaves(passed) if isinstance(leaf, jax.Array)]
        assert arrays and not any(leaf.is_deleted() for leaf in arrays)
        # The batch moves on by reference: no copy of it inside the program.
        new_state = result[-1]
        assert new_state.last_step_inputs.sparse_inputs["ids"] is batch.sparse_inputs["ids"]
        assert new_state.step_before_last_step_inputs.sparse_inputs is last.sparse_inputs
        return result

    return checked


@pytest.mark.parametrize("multiplier", [False, True], ids=["fake_tc_step", "multiplier"])
def test_jit_step_trains_bitwise_like_the_jitted_step(multiplier):
    table, train_state, batches = make_problem(8)
    expected = train_pipelined(
        table, train_state, batches, jit_step(donate=False), multiplier=multiplier
    )
    table = jnp.asarray(table)  # donatable from the first call on
    got = train_pipelined(
        table, train_state, batches, checked_jit_step(), multiplier=multiplier, stages=()
    )
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def test_jit_step_hands_each_result_a_buffer_its_call_has_done_reading():
    """New activations take the buffer of the gradients the update read, new gradients
    that of the activations the TC stage read: a result given the buffer of a value
    its own call still reads makes XLA copy that value first (and the result after)."""
    table, train_state, batches = make_problem(4)
    table = jnp.asarray(table)
    state = get_initial_state(batches[0], train_state, table, lookup, dense_train)
    run = parallel.jit_step(lookup, dense_train, sgd_update)
    for t, batch in enumerate(batches[:3]):
        last, before_last = state.last_step_inputs, state.step_before_last_step_inputs
        read = {
            "activations": last.embedding_activations.unsafe_buffer_pointer(),
            "gradients": before_last.embedding_gradients.unsafe_buffer_pointer(),
        }
        *_, train_state, table, state = run(
            batch, train_state, table, state, fake_tc_step=not is_output_valid(t, 4)
        )
        new_last, new_before_last = state.last_step_inputs, state.step_before_last_step_inputs
        if t:  # the first call's TC stage is fake and leaves its inputs alone
            assert new_last.embedding_activations.unsafe_buffer_pointer() == read["gradients"]
            assert (
                new_before_last.embedding_gradients.unsafe_buffer_pointer() == read["activations"]
            )


@pytest.mark.parametrize("driver", [parallel.jit_step, parallel.host_driven_step])
def test_a_dropped_step_keeps_none_of_its_stages_alive(driver):
    """A training run's step, once dropped, takes its stages (and so its
    programs) with it: with the stages as static arguments of one module-level
    jitted function, JAX's process-wide cache of it kept every run's, and a
    process that trained many times ran out of memory mappings."""
    table, train_state, batches = make_problem(1)

    def own_lookup(sparse, table):  # a new function, as each run's stages are
        return lookup(sparse, table)

    alive = weakref.ref(own_lookup)
    state = get_initial_state(batches[0], train_state, jnp.asarray(table), lookup, dense_train)
    run = driver(own_lookup, dense_train, sgd_update)
    jax.block_until_ready(
        run(batches[0], train_state, jnp.asarray(table), state, fake_tc_step=True)
    )
    del run, own_lookup
    gc.collect()
    assert alive() is None


def test_jit_step_checks_its_call_like_step(one_batch):
    batch, train_state, table, state = one_batch
    run = parallel.jit_step(lookup, dense_train, sgd_update)
    with pytest.raises(TypeError, match="pipeline_state must be a PipelineState"):
        run(batch, train_state, table, tuple(state), fake_tc_step=False)


def primitive_names(jaxpr):
    names = {eqn.primitive.name for eqn in jaxpr.eqns}
    for sub in jax.extend.core.subjaxprs(jaxpr):
        names |= primitive_names(sub)
    return names


@pytest.mark.parametrize("fake_tc_step", [True, False])
def test_fake_step_does_not_trace_the_tc_stage_and_no_step_branches(fake_tc_step):
    traces = []

    def counting_train(*args):
        traces.append(None)
        return dense_train(*args)

    table, train_state, batches = make_problem(1)
    state = get_initial_state(batches[0], train_state, table, lookup, counting_train)
    before = len(traces)
    traced = jax.make_jaxpr(
        functools.partial(
            step,
            sc_fwd_function=lookup,
            tc_function=counting_train,
            sc_bwd_function=sgd_update,
            fake_tc_step=fake_tc_step,
        )
    )(batches[0], train_state, table, state)
    assert len(traces) - before == (0 if fake_tc_step else 1)
    assert not primitive_names(traced.jaxpr) & {"cond", "switch", "while"}


# ---------------------------------------------------------------------------
# Stacked activations: unstack first, stack last inside the TC stage.

FEATURES = ("a", "b")


def stacked_lookup(sparse, table):
    """Both features' samples one after the other, as one stacked table lays them out."""
    ids = jnp.concatenate([sparse[f] for f in FEATURES], axis=0)
    return table[ids].sum(axis=1), None


def stacked_update(sparse, gradients, table, tc_aux=None):
    ids = jnp.concatenate([sparse[f] for f in FEATURES], axis=0)
    return sgd_update({"ids": ids}, gradients, table)


def unstack(stacked):
    return dict(zip(FEATURES, jnp.split(stacked, len(FEATURES)), strict=True))


def stack(per_feature):
    return jnp.concatenate([per_feature[f] for f in FEATURES], axis=0)


def per_feature_lookup(sparse, table):
    return {f: table[sparse[f]].sum(axis=1) for f in FEATURES}, None


def per_feature_update(sparse, gradients, table, tc_aux=None):
    for f in FEATURES:
        table, _ = sgd_update({"ids": sparse[f]}, gradients[f], table)
    return table, None


def per_feature_train(activations, dense, train_state, sc_fwd_aux=None):
    summed = sum(activations[f] for f in FEATURES)
    grads, output, train_state, tc_aux = dense_train(summed, dense, train_state)
    return {f: grads for f in FEATURES}, output, train_state, tc_aux


def two_feature_problem(num_batches):
    table, train_state, batches = make_problem(2 * num_batches)
    return (
        table,
        train_state,
        [
            CurrentStepInput(
                sparse_inputs={"a": a.sparse_inputs["ids"], "b": b.sparse_inputs["ids"]},
                dense_inputs=a.dense_inputs,
            )
            for a, b in zip(batches[::2], batches[1::2], strict=True)
        ],
    )


def test_unstacked_tc_function_matches_per_feature_stages():
    table, train_state, batches = two_feature_problem(4)
    stacked_train = unstacked_tc_function(
        per_feature_train, unstack_activations=unstack, stack_gradients=stack
    )

    def run(sc_fwd, tc, sc_bwd, table, train_state):
        state = get_initial_state(batches[0], train_state, table, sc_fwd, tc)
        dummy = jax.tree.map(jnp.zeros_like, batches[0])
        n, losses = len(batches), []
        for t in range(get_pipeline_train_steps(n)):
            out, _, train_state, table, state = step(
                batches[t] if t < n else dummy, train_state, table, state,
                sc_fwd, tc, sc_bwd, fake_tc_step=not is_output_valid(t, n),
            )  # fmt: skip
            if is_output_valid(t, n):
                losses.append(out["loss"])
        return table, train_state, losses

    assert_same_training(
        run(stacked_lookup, stacked_train, stacked_update, table, train_state),
        run(per_feature_lookup, per_feature_train, per_feature_update, table, train_state),
    )


def test_unstacked_tc_function_unstacks_first_and_stacks_last():
    calls = []

    def recording(name, fn):
        def wrapped(*args):
            calls.append(name)
            return fn(*args)

        return wrapped

    stacked_train = unstacked_tc_function(
        recording("tc", per_feature_train),
        unstack_activations=recording("unstack", unstack),
        stack_gradients=recording("stack", stack),
    )
    table, train_state, batches = two_feature_problem(1)
    activations, _ = stacked_lookup(batches[0].sparse_inputs, table)
    grads, _, _, _ = stacked_train(activations, batches[0].dense_inputs, train_state)
    assert calls == ["unstack", "tc", "stack"]
    assert grads.shape == activations.shape


# ---------------------------------------------------------------------------
# Sharding over the 8 devices.


def test_sharded_state_and_steps_match_the_unsharded_run():
    mesh = jax.sharding.Mesh(jax.devices(), ("data",))
    by_rows = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())
    table, train_state, batches = make_problem(3)
    expected = train_pipelined(table, train_state, batches, step)

    state = get_initial_state(
        batches[0], train_state, table, lookup, dense_train,
        dense_input_sharding=by_rows, sparse_input_sharding=by_rows,
    )  # fmt: skip
    state_sharding = get_pipeline_state_sharding(
        PipelineState,
        dense_input_sharding=by_rows,
        sparse_input_sharding=by_rows,
        pipeline_output_sharding=replicated,
        tc_aux_sharding=replicated,
    )
    state = jax.device_put(state, state_sharding)
    assert state.last_step_inputs.embedding_activations.sharding == by_rows
    assert state.step_before_last_step_inputs.sparse_inputs["ids"].sharding == by_rows
    assert state.placeholder_output["loss"].sharding == replicated

    put = functools.partial(jax.device_put, device=CurrentStepInput(by_rows, by_rows))
    train_state = jax.device_put(train_state, replicated)
    table = jax.device_put(table, replicated)
    step_fn = jax.jit(step, static_argnames=STATIC)
    n, losses = len(batches), []
    dummy = jax.tree.map(jnp.zeros_like, batches[0])
    for t in range(get_pipeline_train_steps(n)):
        out, _, train_state, table, state = step_fn(
            put(batches[t] if t < n else dummy), train_state, table, state,
            lookup, dense_train, sgd_update, fake_tc_step=not is_output_valid(t, n),
        )  # fmt: skip
        # XLA:CPU must not have two programs with collectives in flight.
        jax.block_until_ready((out, train_state, table, state))
        if is_output_valid(t, n):
            losses.append(out["loss"])
    assert state.last_step_inputs.sparse_inputs["ids"].sharding.spec == P("data")
    # The loss sums per device first: float32 results differ by reassociation.
    assert_same_training((table, train_state, losses), expected, rtol=1e-4)


def _state_on_the_devices():
    """The initial state of a 1-batch problem, inputs by rows of the 8 devices, the
    rest replicated; with its batch and the two shardings."""
    mesh = jax.sharding.Mesh(jax.devices(), ("data",))
    by_rows, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    table, train_state, batches = make_problem(1)
    state = get_initial_state(
        batches[0], train_state, table, lookup, dense_train,
        dense_input_sharding=by_rows, sparse_input_sharding=by_rows,
        replicated_sharding=replicated,
    )  # fmt: skip
    return state, batches[0], by_rows, replicated


def test_the_replicated_sharding_places_every_leaf_the_others_leave():
    state, _, by_rows, replicated = _state_on_the_devices()
    assert state.pipeline_step.sharding == replicated
    assert state.placeholder_output["loss"].sharding == replicated
    assert state.last_step_inputs.embedding_activations.sharding == by_rows
    for leaf in jax.tree.leaves(state):
        assert leaf.sharding in (by_rows, replicated)
        np.testing.assert_array_equal(np.asarray(leaf), 0)


def test_the_draining_input_is_zeros_placed_like_the_last_batch():
    state, batch, by_rows, _ = _state_on_the_devices()
    last = state.last_step_inputs
    like = CurrentStepInput(last.sparse_inputs, last.dense_inputs)
    drained = parallel.get_draining_input(state)
    assert jax.tree.structure(drained) == jax.tree.structure(batch)
    assert {x.sharding for x in jax.tree.leaves(drained)} == {by_rows}
    for got, model in zip(jax.tree.leaves(drained), jax.tree.leaves(like), strict=True):
        assert (got.shape, got.dtype, got.sharding) == (model.shape, model.dtype, model.sharding)
        np.testing.assert_array_equal(np.asarray(got), np.zeros(model.shape, model.dtype))
        # Its own buffers, not the state's placeholders: a caller may donate them.
        assert {s.data.unsafe_buffer_pointer() for s in got.addressable_shards}.isdisjoint(
            s.data.unsafe_buffer_pointer() for s in model.addressable_shards
        )


# ---------------------------------------------------------------------------
# Errors.


@pytest.fixture
def one_batch():
    table, train_state, batches = make_problem(1)
    state = get_initial_state(batches[0], train_state, table, lookup, dense_train)
    return batches[0], train_state, table, state


@pytest.mark.parametrize(
    "driver",
    [functools.partial(parallel.jit_step, donate=False), parallel.host_driven_step],
    ids=["jit_step", "host_driven_step"],
)
def test_the_drivers_compile_with_the_xla_options_given(one_batch, driver):
    run = driver(lookup, dense_train, sgd_update, compiler_options={"xla_no_such_option": 1})
    with pytest.raises(jax.errors.JaxRuntimeError, match="xla_no_such_option"):
        run(*one_batch, fake_tc_step=False)


def test_traced_fake_tc_step_asks_for_a_static_flag(one_batch):
    not_static = jax.jit(step, static_argnames=STATIC[:3])
    with pytest.raises(TypeError, match="fake_tc_step must be a Python bool.*static_argnames"):
        not_static(*one_batch, lookup, dense_train, sgd_update, fake_tc_step=False)


@pytest.mark.parametrize(
    ("fake_tc_step", "multiplier", "message"),
    [
        (True, 1.0, "pass fake_tc_step=False with it"),
        (False, np.ones(2, np.float32), r"must be a scalar, got shape \(2,\)"),
    ],
)
def test_bad_gradient_multiplier(one_batch, fake_tc_step, multiplier, message):
    with pytest.raises(ValueError, match=message):
        step(
            *one_batch, lookup, dense_train, sgd_update,
            fake_tc_step=fake_tc_step, gradient_multiplier=multiplier,
        )  # fmt: skip


def test_pipeline_input_must_be_a_current_step_input(one_batch):
    batch, *rest = one_batch
    with pytest.raises(TypeError, match="pipeline_input must be a CurrentStepInput"):
        step(tuple(batch), *rest, lookup, dense_train, sgd_update, fake_tc_step=False)


def test_pipeline_state_must_be_a_pipeline_state(one_batch):
    *head, state = one_batch
    with pytest.raises(TypeError, match="pipeline_state must be a PipelineState"):
        step(*head, tuple(state), lookup, dense_train, sgd_update, fake_tc_step=False)


def test_stage_returning_the_wrong_number_of_values(one_batch):
    def three_values(*args):
        return dense_train(*args)[:3]

    batch, train_state, table, _ = one_batch
    with pytest.raises(ValueError, match=r"tc_function must return a tuple \(embedding_gradients"):
        get_initial_state(batch, train_state, table, lookup, three_values)


def test_tc_stage_must_keep_the_train_state_structure(one_batch):
    def drops_optimizer_state(*args):
        grads, out, (params, _), aux = dense_train(*args)
        return grads, out, params, aux

    batch, train_state, table, _ = one_batch
    with pytest.raises(ValueError, match="train state with the structure"):
        get_initial_state(batch, train_state, table, lookup, drops_optimizer_state)


def test_public_names():
    for name in [
        "CurrentStepInput",
        "LastStepInput",
        "StepBeforeLastStepInput",
        "PipelineState",
        "ScFwdStageFun",
        "TcStageFun",
        "ScBwdStageFun",
        "step",
        "jit_step",
        "get_initial_state",
        "get_pipeline_state_sharding",
        "get_pipeline_train_steps",
        "is_output_valid",
        "unstacked_tc_function",
    ]:
        assert name in parallel.__all__
