"""Pipeshard parallelism: pipeline stages on sub-meshes, data parallel inside.

Alpa's pipeshard execution on current JAX with a single controller: mark
layer boundaries in the model, take the gradient with this package's
`value_and_grad`, and `parallelize` the train step. Layers are cut from the
traced program (at the markers, or by cost), grouped into stages (uniformly,
by measured times, or by hand), and each stage runs forward and backward
for every microbatch on its own slice of the devices, in a GPipe, 1F1B,
interleaved 1F1B (virtual stages) or zero-bubble (ZB-H1) schedule;
gradients are accumulated and the update is applied per stage.
"""

from parallel.pipeshard._api import (
    DenseStageFn,
    PipeshardFunction,
    parallelize,
    pipeshard_value_and_grad,
)
from parallel.pipeshard._grad import grad, value_and_grad
from parallel.pipeshard._markers import MarkerKind, mark_pipeline_boundary, pipeline_marker_p
from parallel.pipeshard._options import (
    AutoLayerOption,
    AutoStageOption,
    LossReduction,
    ManualLayerOption,
    ManualStageOption,
    PipelineSchedule,
    PipeshardParallel,
    UniformStageOption,
)
from parallel.pipeshard._plot import TimelineAxis, plot_schedule
from parallel.pipeshard._runtime import PipeshardExecutable
from parallel.pipeshard._sc_tc_adapter import (
    HostDrivenStageError,
    PipeshardTcStage,
    TcTrainState,
    pipeshard_tc_function,
)
from parallel.pipeshard._schedules import (
    ExecutedSchedule,
    Task,
    TaskKind,
    TaskRecord,
    build_schedule,
    clock_bubble_fraction,
    max_inflight_microbatches,
    theoretical_bubble_fraction,
)
from parallel.pipeshard._stages import StagePlan

__all__ = [
    "AutoLayerOption",
    "AutoStageOption",
    "DenseStageFn",
    "ExecutedSchedule",
    "HostDrivenStageError",
    "LossReduction",
    "ManualLayerOption",
    "ManualStageOption",
    "MarkerKind",
    "PipelineSchedule",
    "PipeshardExecutable",
    "PipeshardFunction",
    "PipeshardParallel",
    "PipeshardTcStage",
    "StagePlan",
    "Task",
    "TaskKind",
    "TaskRecord",
    "TcTrainState",
    "TimelineAxis",
    "UniformStageOption",
    "build_schedule",
    "clock_bubble_fraction",
    "grad",
    "mark_pipeline_boundary",
    "max_inflight_microbatches",
    "parallelize",
    "pipeline_marker_p",
    "pipeshard_tc_function",
    "pipeshard_value_and_grad",
    "plot_schedule",
    "theoretical_bubble_fraction",
    "value_and_grad",
]
