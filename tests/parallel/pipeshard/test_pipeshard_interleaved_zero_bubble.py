"""Interleaved 1F1B (virtual stages) and zero bubble (ZB-H1).

Structure on the built clocks (dependencies, clock counts, bubbles against
the literature's, activations held), then the executed steps against
`jax.value_and_grad` plus the same optax update, jitted as one program.
"""

import functools

import jax
import numpy as np
import optax
import pytest
from pipeshard_models import (
    TrainState,
    check_dependencies,
    mlp_batch,
    mlp_init,
    mlp_loss,
    train_step,
)

from parallel import pipeshard
from parallel.pipeshard import PipelineSchedule, TaskKind

INTERLEAVED = PipelineSchedule.INTERLEAVED_ONE_F_ONE_B
ZERO_BUBBLE = PipelineSchedule.ZERO_BUBBLE
TX = optax.adam(0.05)


SHAPES = [(m, p) for m in (1, 2, 3, 4, 8, 16) for p in (1, 2, 3, 4)]


@pytest.mark.parametrize(("m", "p"), SHAPES)
@pytest.mark.parametrize("v", [1, 2, 3])
def test_interleaved_clocks(m, p, v):
    clocks = pipeshard.build_schedule(INTERLEAVED, m, p, v)
    assert len(check_dependencies(clocks, p, v)) == 2 * m * p * v
    bubble = pipeshard.clock_bubble_fraction(clocks, p)
    theory = pipeshard.theoretical_bubble_fraction(INTERLEAVED, m, p, v)
    if m % p == 0:  # Megatron-LM's condition for the interleaved bound
        assert len(clocks) == 2 * (v * m + p - 1)
        assert bubble == pytest.approx(theory)
    # Never worse than 1F1B over the same devices.
    assert bubble <= (p - 1) / (m + p - 1) + 1e-12


@pytest.mark.parametrize(("m", "p"), [(m, p) for m, p in SHAPES if m >= 2 * p])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_holds_no_more_than_gpipe(m, p, v):
    """Activations held per group, in whole-stage units (a chunk is 1/v of a stage)."""
    tasks = [t for clock in pipeshard.build_schedule(INTERLEAVED, m, p, v) for t in clock]
    for group in range(p):
        assert pipeshard.max_inflight_microbatches(tasks, group, p) / v <= m


@pytest.mark.parametrize(("m", "p"), SHAPES)
def test_zero_bubble_clocks(m, p):
    clocks = pipeshard.build_schedule(ZERO_BUBBLE, m, p)
    assert len(check_dependencies(clocks, p)) == 3 * m * p
    tasks = [t for clock in clocks for t in clock]
    for stage in range(p):  # 1F1B's peak, that of its first stage
        assert pipeshard.max_inflight_microbatches(tasks, stage) <= min(p, m)
    if m >= p:
        assert len(clocks) == 3 * m + p - 1
        bubble = pipeshard.clock_bubble_fraction(clocks, p)
        assert bubble == pytest.approx(pipeshard.theoretical_bubble_fraction(ZERO_BUBBLE, m, p))
        # 1F1B with the same F, B and W times idles 3 (p - 1) of 3 (m + p - 1) units.
        one_f_one_b = (p - 1) / (m + p - 1)
        assert bubble <= one_f_one_b * (m + p - 1) / (3 * m + p - 1) + 1e-12


def test_virtual_stages_need_the_interleaved_schedule():
    with pytest.raises(ValueError, match="interleaved_1f1b"):
        pipeshard.PipeshardParallel(num_micro_batches=2, virtual_stages=2)
    with pytest.raises(ValueError, match="interleaved_1f1b"):
        pipeshard.build_schedule(PipelineSchedule.ONE_F_ONE_B, 2, 2, 2)


def test_virtual_stages_must_divide_the_layers():
    method = pipeshard.PipeshardParallel(
        num_micro_batches=2,
        pipeline_schedule="interleaved_1f1b",
        virtual_stages=3,
        stage_option=pipeshard.UniformStageOption(num_stages=2),
    )
    step = pipeshard.parallelize(train_step(pipeshard.value_and_grad, TX, mlp_loss), method=method)
    with pytest.raises(ValueError, match="6 stages"):
        step(*_inputs(False, 4))


# ---- executed steps against the reference -------------------------------------


def _inputs(tied, layers):
    rng = np.random.default_rng(0)
    params = mlp_init(rng, tied=tied, layers=layers)
    return TrainState(params, TX.init(params)), mlp_batch(rng)


@functools.cache
def _reference():
    return jax.jit(train_step(jax.value_and_grad, TX, mlp_loss))


@functools.cache
def _interleaved(num_stages, m, tied):
    """`num_stages` groups of 2 virtual stages: a 2 * num_stages layer MLP."""
    method = pipeshard.PipeshardParallel(
        num_micro_batches=m,
        pipeline_schedule="interleaved_1f1b",
        virtual_stages=2,
        stage_option=pipeshard.UniformStageOption(num_stages=num_stages),
    )
    return pipeshard.parallelize(train_step(pipeshard.value_and_grad, TX, mlp_loss), method=method)


@functools.cache
def _zero_bubble(num_stages, m, tied):
    method = pipeshard.PipeshardParallel(
        num_micro_batches=m,
        pipeline_schedule="zero_bubble",
        stage_option=pipeshard.UniformStageOption(num_stages=num_stages),
    )
    return pipeshard.parallelize(train_step(pipeshard.value_and_grad, TX, mlp_loss), method=method)


def _assert_steps_match(step, inputs, steps=2):
    state, batch = inputs
    reference_state = state
    for _ in range(steps):
        got = step(state, batch)
        want = _reference()(reference_state, batch)
        jax.tree.map(
            lambda g, w: np.testing.assert_allclose(
                np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6
            ),
            got,
            want,
        )
        state, reference_state = got[0], want[0]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("num_stages", [2, 4])
def test_interleaved_matches_reference(num_stages, m, tied):
    step = _interleaved(num_stages, m, tied)
    inputs = _inputs(tied, layers=2 * num_stages)
    _assert_steps_match(step, inputs)
    record = step.last_schedule
    assert (record.num_stages, record.virtual_stages) == (num_stages, 2)
    executable = step.get_executable(*inputs)
    # Stage c runs on group c % p: chunks 0 and p share their devices.
    assert executable.meshes[0] is executable.meshes[num_stages]
    assert executable.meshes[0] is not executable.meshes[1]
    check_dependencies(record.clocks, num_stages, 2)
    if m % num_stages == 0:
        assert record.clock_bubble_fraction() == pytest.approx(record.theoretical_bubble_fraction())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("num_stages", [2, 4])
def test_zero_bubble_matches_reference(num_stages, m, tied):
    step = _zero_bubble(num_stages, m, tied)
    inputs = _inputs(tied, layers=4)
    _assert_steps_match(step, inputs)
    record = step.last_schedule
    kinds = {(r.task.stage, r.task.kind) for r in record.records}
    assert kinds == {(s, k) for s in range(num_stages) for k in TaskKind}
    # Weight gradients really run apart from input gradients: W pieces exist
    # and their B pieces hand them values instead of computing them.
    program = step.get_executable(*inputs).program
    for stage in range(num_stages):
        weight = program.piece(stage, TaskKind.WEIGHT)
        assert weight is not None and weight.sum_outputs and not weight.transfer_outputs
        assert not set(program.piece(stage, TaskKind.BACKWARD).sum_outputs) & set(
            weight.sum_outputs
        )
    check_dependencies(record.clocks, num_stages)


def test_zero_bubble_shares_forward_programs_with_other_schedules():
    """Switching schedules at run time keeps the forwards' compiled programs."""
    step = _zero_bubble(2, 4, False)
    inputs = _inputs(False, layers=4)
    step(*inputs)
    one_f_one_b = step.with_runtime_options(pipeline_schedule="1f1b")
    _assert_steps_match(one_f_one_b, inputs, steps=1)
    zb = step.get_executable(*inputs)
    other = one_f_one_b.get_executable(*inputs)
    assert zb._compiled is other._compiled  # noqa: SLF001 - the shared compile cache
    assert other.program.piece(0, TaskKind.WEIGHT) is None


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zero_bubble"])
def test_plot_schedule_draws_new_schedules(tmp_path, schedule):
    import matplotlib.image

    step = (
        _interleaved(2, 4, False) if schedule == "interleaved_1f1b" else _zero_bubble(2, 4, False)
    )
    step(*_inputs(False, layers=4))
    path = tmp_path / "schedule.png"
    step.plot_schedule(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(path).shape
    assert height > 100 and width > 100
