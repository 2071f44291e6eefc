"""A pipeshard dense tower as the TC stage of the SC/TC pipelined step.

A tiny recommender on 8 devices: one sharded embedding table looked up and
updated by `embedding` on a 1-D mesh, and a two-layer MLP tower cut into
2 pipeline stages of 4 devices with 2 microbatches. `parallel.step` runs
eagerly with `pipeshard.pipeshard_tc_function` as its TC stage; the
reference is the same pipelined run with a jitted `jax.value_and_grad` TC
stage and the same optax update. Every call is waited for before the next
(XLA:CPU must not run two programs with collectives at once).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import embedding
import parallel
from parallel import pipeshard
from parallel.pipeshard import TcTrainState

BATCH, VOCAB, DIM, NUM_DENSE, HIDDEN = 32, 64, 8, 4, 16
NUM_BATCHES = 4
TX = optax.adam(0.05)
METHOD = pipeshard.PipeshardParallel(
    num_micro_batches=2, stage_option=pipeshard.UniformStageOption(num_stages=2)
)


def loss_fn(params, activations, dense):
    """Mean squared error of a two-layer MLP on [embedding, dense features]."""
    x = jnp.concatenate([activations["f"], dense["x"]], axis=1)
    h = jnp.tanh(x @ params["w0"] + params["b0"])
    pipeshard.mark_pipeline_boundary()
    prediction = h @ params["w1"] + params["b1"]
    return jnp.mean((prediction[:, 0] - dense["y"]) ** 2)


@functools.cache
def _setup():
    mesh = Mesh(np.array(jax.devices()), ("devices",))
    table = embedding.TableSpec(
        name="t",
        vocabulary_size=VOCAB,
        embedding_dim=DIM,
        initializer=embedding.initializers.Normal(stddev=0.5),
        optimizer=embedding.SGDOptimizerSpec(learning_rate=0.5),
        combiner="sum",
        max_ids_per_partition=32,
        max_unique_ids_per_partition=32,
    )
    feature = embedding.FeatureSpec(
        name="f", table_spec=table, input_shape=[BATCH, 3], output_shape=[BATCH, DIM]
    )
    specs = embedding.prepare_feature_specs_for_training({"f": feature}, mesh.size, 1)
    return mesh, specs


def _batch(seed, specs, mesh):
    rng = np.random.default_rng(seed)
    ids = np.empty(BATCH, dtype=object)
    weights = np.empty(BATCH, dtype=object)
    for row in range(BATCH):
        count = int(rng.integers(1, 4))
        ids[row] = rng.integers(0, VOCAB, count).astype(np.int64)
        weights[row] = np.ones(count, np.float32)
    sparse, _ = embedding.preprocess_sparse_dense_matmul_input(
        {"f": ids}, {"f": weights}, specs, mesh.size, mesh.size, num_sc_per_device=1
    )
    dense = {
        "x": rng.normal(size=(BATCH, NUM_DENSE)).astype(np.float32),
        "y": rng.normal(size=BATCH).astype(np.float32),
    }
    return parallel.CurrentStepInput(sparse_inputs=sparse, dense_inputs=dense)


@functools.cache
def _sparse_stages():
    """The SC forward and backward stages (`embedding` lookup and SGD update), jitted."""
    mesh, specs = _setup()

    @jax.jit
    def sc_fwd(sparse, tables):
        return embedding.sparse_dense_matmul(sparse, tables, specs, mesh), None

    @jax.jit
    def sc_bwd(sparse, grads, tables, step):
        return embedding.apply_gradients(grads, sparse, tables, specs, mesh, step), None

    return sc_fwd, sc_bwd


@functools.cache
def _reference_tc():
    """The TC stage written directly: `jax.value_and_grad` and the optax update, jitted."""

    @jax.jit
    def tc(activations, dense, state, sc_fwd_aux=None):
        loss, (param_grads, activation_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            state.params, activations, dense
        )
        updates, opt_state = TX.update(param_grads, state.opt_state, state.params)
        new_state = TcTrainState(
            optax.apply_updates(state.params, updates), opt_state, state.step + 1
        )
        return activation_grads, loss, new_state, state.step

    return tc


def _initial_train_state(mesh):
    rng = np.random.default_rng(0)
    params = {
        "w0": rng.normal(size=(DIM + NUM_DENSE, HIDDEN)) * 0.3,
        "b0": rng.normal(size=HIDDEN) * 0.1,
        "w1": rng.normal(size=(HIDDEN, 1)) * 0.3,
        "b1": np.zeros(1),
    }
    params = {k: np.asarray(v, np.float32) for k, v in params.items()}
    replicated = NamedSharding(mesh, P())
    return jax.device_put(TcTrainState.create(params, TX), replicated)


def _run(tc, *, one_program, host_driven=False):
    """`NUM_BATCHES` batches through `parallel.step` eagerly.

    With `one_program`, the boundary calls run the TC stage too and discard
    it with `gradient_multiplier` instead of skipping it. With
    `host_driven`, through `parallel.host_driven_step` instead.

    Returns:
      (losses of the valid calls, final dense params, final logical tables).
    """
    mesh, specs = _setup()
    sc_fwd, sc_bwd = _sparse_stages()
    batches = [_batch(seed, specs, mesh) for seed in range(NUM_BATCHES)]
    dummy = jax.tree.map(np.zeros_like, batches[0])
    train_state = _initial_train_state(mesh)
    tables = embedding.init_embedding_variables(jax.random.key(3), specs, mesh, num_sc_per_device=1)
    state = parallel.get_initial_state(batches[0], train_state, tables, sc_fwd, tc)
    run_step = (
        parallel.host_driven_step(sc_fwd, tc, sc_bwd)
        if host_driven
        else functools.partial(parallel.step, sc_fwd_function=sc_fwd, tc_function=tc,
                               sc_bwd_function=sc_bwd)
    )  # fmt: skip
    losses = []
    for t in range(parallel.get_pipeline_train_steps(NUM_BATCHES)):
        valid = parallel.is_output_valid(t, NUM_BATCHES)
        flags = (
            {"fake_tc_step": False, "gradient_multiplier": np.float32(valid)}
            if one_program
            else {"fake_tc_step": not valid}
        )
        out, _, train_state, tables, state = jax.block_until_ready(
            run_step(batches[t] if t < NUM_BATCHES else dummy, train_state, tables, state, **flags)
        )
        if valid:
            losses.append(float(out))
    logical = embedding.gather_tables(
        {name: v.table for name, v in tables.items()}, specs, mesh, num_sc_per_device=1
    )
    return np.array(losses), jax.device_get(train_state.params), logical


@functools.cache
def _pipeshard_tc():
    return pipeshard.pipeshard_tc_function(loss_fn, TX, method=METHOD)


def _initial_tables(specs, mesh):
    tables = embedding.init_embedding_variables(jax.random.key(3), specs, mesh, num_sc_per_device=1)
    return embedding.gather_tables(
        {name: v.table for name, v in tables.items()}, specs, mesh, num_sc_per_device=1
    )["t"]


@pytest.mark.parametrize(
    ("one_program", "host_driven"),
    [(False, False), (True, False), (False, True)],
    ids=["fake_tc_step", "multiplier", "host_driven_step"],
)
def test_pipeshard_tc_stage_matches_plain_tc_stage(one_program, host_driven):
    tc = _pipeshard_tc()
    losses, params, tables = _run(tc, one_program=one_program, host_driven=host_driven)
    want_losses, want_params, want_tables = _run(_reference_tc(), one_program=one_program)
    assert losses.shape == (NUM_BATCHES,)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for name in want_params:
        np.testing.assert_allclose(params[name], want_params[name], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tables["t"], want_tables["t"], rtol=1e-5, atol=1e-6)
    # The dense stage really ran as a pipeline, and the run trained.
    schedule = tc.pipeshard_function.last_schedule
    assert (schedule.num_stages, schedule.num_microbatches) == (2, 2)
    assert {(r.task.stage, r.task.microbatch) for r in schedule.records} == {
        (stage, micro) for stage in range(2) for micro in range(2)
    }
    mesh, specs = _setup()
    assert not np.allclose(params["w0"], _initial_train_state(mesh).params["w0"])
    assert not np.allclose(tables["t"], _initial_tables(specs, mesh))


def test_pipeshard_tc_stage_rejects_a_foreign_train_state():
    mesh, specs = _setup()
    batch = _batch(0, specs, mesh)
    activations = {"f": np.zeros((BATCH, DIM), np.float32)}
    params = jax.device_get(_initial_train_state(mesh).params)
    with pytest.raises(TypeError, match="TcTrainState"):
        _pipeshard_tc()(activations, batch.dense_inputs, (params, TX.init(params)))


def _traced_step_inputs():
    mesh, specs = _setup()
    sc_fwd, _ = _sparse_stages()
    batch = _batch(0, specs, mesh)
    train_state = _initial_train_state(mesh)
    tables = embedding.init_embedding_variables(jax.random.key(3), specs, mesh, num_sc_per_device=1)
    state = parallel.get_initial_state(batch, train_state, tables, sc_fwd, _pipeshard_tc())
    return batch, train_state, tables, state


@pytest.mark.parametrize("how", ["jit_step", "jax.jit", "eval_shape"])
def test_pipeshard_tc_stage_refuses_to_be_traced(how):
    """No silent fallback to an unpipelined dense stage under a trace."""
    batch, train_state, tables, state = _traced_step_inputs()
    sc_fwd, sc_bwd = _sparse_stages()
    tc = _pipeshard_tc()
    with pytest.raises(pipeshard.HostDrivenStageError, match="host_driven_step"):
        if how == "jit_step":
            parallel.jit_step(sc_fwd, tc, sc_bwd, donate=False)(
                batch, train_state, tables, state, fake_tc_step=False
            )
        elif how == "jax.jit":
            jax.jit(
                parallel.step,
                static_argnames=("sc_fwd_function", "tc_function", "sc_bwd_function",
                                 "fake_tc_step"),
            )(batch, train_state, tables, state, sc_fwd_function=sc_fwd, tc_function=tc,
              sc_bwd_function=sc_bwd, fake_tc_step=False)  # fmt: skip
        else:
            last = state.last_step_inputs
            jax.eval_shape(tc, last.embedding_activations, batch.dense_inputs, train_state)


def test_pipeshard_tc_stage_gives_its_shapes_untraced():
    """`get_initial_state` reads the shapes off `shape_function`, never the pipeline."""
    _, train_state, _, state = _traced_step_inputs()
    assert state.step_before_last_step_inputs.embedding_gradients["f"].shape == (BATCH, DIM)
    assert state.placeholder_output.shape == ()
    assert jax.tree.structure(state.placeholder_tc_aux) == jax.tree.structure(train_state.step)


def test_host_driven_step_refuses_a_gradient_multiplier():
    batch, train_state, tables, state = _traced_step_inputs()
    sc_fwd, sc_bwd = _sparse_stages()
    run_step = parallel.host_driven_step(sc_fwd, _pipeshard_tc(), sc_bwd)
    with pytest.raises(ValueError, match="no gradient_multiplier"):
        run_step(batch, train_state, tables, state, fake_tc_step=False, gradient_multiplier=1.0)
