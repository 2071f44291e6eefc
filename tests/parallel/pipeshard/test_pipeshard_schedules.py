"""Schedule structure, on the built clocks and on recorded executions."""

import functools

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

SHAPES = [(m, p) for m in (1, 2, 3, 4, 8) for p in (1, 2, 3, 4)]
ALPA_SCHEDULES = [PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B]


@pytest.mark.parametrize(("m", "p"), SHAPES)
@pytest.mark.parametrize("kind", ALPA_SCHEDULES)
def test_every_task_once_after_its_inputs(kind, m, p):
    clocks = pipeshard.build_schedule(kind, m, p)
    assert len(check_dependencies(clocks, p)) == 2 * m * p


@pytest.mark.parametrize(("m", "p"), SHAPES)
@pytest.mark.parametrize("kind", ALPA_SCHEDULES)
def test_both_schedules_take_2_m_plus_p_minus_1_clocks(kind, m, p):
    clocks = pipeshard.build_schedule(kind, m, p)
    assert len(clocks) == 2 * (m + p - 1)
    assert pipeshard.clock_bubble_fraction(clocks, p) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(("m", "p"), SHAPES)
def test_one_f_one_b_bounds_activations_per_stage(m, p):
    clocks = pipeshard.build_schedule(PipelineSchedule.ONE_F_ONE_B, m, p)
    tasks = [t for clock in clocks for t in clock]
    for stage in range(p):
        assert pipeshard.max_inflight_microbatches(tasks, stage) == min(p - stage, m)


@pytest.mark.parametrize(("m", "p"), SHAPES)
def test_gpipe_holds_every_microbatch(m, p):
    tasks = [t for clock in pipeshard.build_schedule(PipelineSchedule.GPIPE, m, p) for t in clock]
    assert all(pipeshard.max_inflight_microbatches(tasks, s) == m for s in range(p))


TX = optax.sgd(0.1)


@functools.cache
def _mlp_function(m):
    rng = np.random.default_rng(0)
    params = mlp_init(rng)
    inputs = (TrainState(params, TX.init(params)), mlp_batch(rng))
    method = pipeshard.PipeshardParallel(num_micro_batches=m, time_tasks=True)
    function = pipeshard.parallelize(
        train_step(pipeshard.value_and_grad, TX, mlp_loss), method=method
    )
    function.get_executable(*inputs)
    return function, inputs


@pytest.mark.parametrize("kind", ALPA_SCHEDULES)
def test_recorded_schedule(kind):
    """The executed record: GPipe's clock count, 1F1B's activation bound."""
    m, p = 4, 4
    base, inputs = _mlp_function(m)
    function = base.with_runtime_options(pipeline_schedule=kind)
    function(*inputs)
    record = function.last_schedule
    assert record.schedule is kind
    assert record.num_clocks == 2 * (m + p - 1)
    check_dependencies(record.clocks, p)
    bound = {PipelineSchedule.GPIPE: lambda s: m, PipelineSchedule.ONE_F_ONE_B: lambda s: p - s}
    for stage in range(p):
        assert record.max_inflight_microbatches(stage) <= bound[kind](stage)
    assert record.clock_bubble_fraction() == pytest.approx((p - 1) / (m + p - 1))
    assert all(r.duration is not None and r.duration >= 0 for r in record.records)
    assert 0.0 <= record.measured_bubble_fraction() < 1.0


def test_simulated_timeline_respects_dependencies():
    base, inputs = _mlp_function(2)
    base(*inputs)
    record = base.last_schedule
    timeline = record.simulated_timeline()
    for task, (start, end) in timeline.items():
        assert end >= start
        if task.kind is TaskKind.FORWARD and task.stage > 0:
            upstream = pipeshard.Task(
                stage=task.stage - 1, microbatch=task.microbatch, kind=task.kind
            )
            assert timeline[upstream][1] <= start


def test_untimed_record_has_no_measured_timeline():
    base, inputs = _mlp_function(2)
    function = base.with_runtime_options(time_tasks=False)
    function(*inputs)
    with pytest.raises(ValueError, match="time_tasks=True"):
        function.last_schedule.simulated_timeline()


@pytest.mark.parametrize("timing", ["clock", "measured"])
def test_plot_schedule_writes_png(tmp_path, timing):
    import matplotlib.image

    base, inputs = _mlp_function(2)
    base(*inputs)
    path = tmp_path / "schedule.png"
    base.plot_schedule(path, timing=timing)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(path).shape
    assert height > 100 and width > 100
