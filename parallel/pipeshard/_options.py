"""The options of `parallelize(..., method=PipeshardParallel(...))`."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from embedding.checks import check_positive_int


class PipelineSchedule(enum.Enum):
    """Order in which stages run the forward and backward of microbatches.

    GPIPE: every forward, then every backward; each stage holds the
      activations of all microbatches.
    ONE_F_ONE_B: after a warm-up of `p - i - 1` forwards, stage `i`
      alternates one forward and one backward, so it never holds more than
      `p - i` microbatches' activations. Same number of clocks as GPipe.

    INTERLEAVED_ONE_F_ONE_B: 1F1B over `v` virtual stages per device group
      (Megatron-LM's interleaved schedule): the model is cut into `p * v`
      chunks and group `d` runs chunks `d, d + p, ...`, so the pipeline
      fills `v` times faster: bubble `(p - 1) / (v m + p - 1)`. Set
      `PipeshardParallel.virtual_stages`.
    ZERO_BUBBLE: ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"):
      each backward is split into B, the input gradient the stage before
      waits for, and W, the weight gradient, which is deferred into 1F1B's
      bubbles; 1F1B's activation bound, about a third of its bubble.
    """

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_ONE_F_ONE_B = "interleaved_1f1b"
    ZERO_BUBBLE = "zero_bubble"


class LossReduction(enum.Enum):
    """How the loss reduces over the examples of a batch.

    Microbatching is exact only for a loss that is the MEAN (or SUM) of
    per-example terms: the loss and gradients of the batch are then the mean
    (or sum) of those of its equal-sized microbatches. A loss that couples
    examples (batch statistics, in-batch negatives) changes when split.
    """

    MEAN = "mean"
    SUM = "sum"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManualLayerOption:
    """Layers are cut at the `mark_pipeline_boundary()` calls of the model."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoLayerOption:
    """Layers are cut automatically from the traced forward program.

    The forward operations are split, in program order, into `layer_num`
    layers whose FLOPs are balanced (the largest layer is at most
    `1 + flops_tolerance` times the smallest achievable maximum), choosing
    among such cuts the one with the fewest bytes of activations crossing
    the cuts. Boundary markers in the model are ignored.

    Attributes:
      layer_num: number of layers.
      flops_tolerance: slack on the balance, traded for fewer bytes crossed.
    """

    layer_num: int
    flops_tolerance: float = 0.1

    def __post_init__(self):
        check_positive_int(self.layer_num, "AutoLayerOption.layer_num")
        if not self.flops_tolerance >= 0:
            raise ValueError(
                f"AutoLayerOption.flops_tolerance must be >= 0, got {self.flops_tolerance!r}."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class UniformStageOption:
    """Layers split into equal contiguous groups, devices into equal sub-meshes.

    Attributes:
      num_stages: number of stages; None gives one stage per layer. It must
        divide the number of layers. Devices are dealt out as evenly as
        possible, earlier stages taking the remainder.
    """

    num_stages: int | None = None

    def __post_init__(self):
        if self.num_stages is not None:
            check_positive_int(self.num_stages, "UniformStageOption.num_stages")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoStageOption:
    """Stages chosen from measured stage times.

    Every contiguous range of layers is compiled onto every allowed sub-mesh
    size and its forward plus backward for one microbatch is timed; the
    partition of the layers into stages, and of all the devices into
    sub-meshes, minimizing `sum(t_i) + (m - 1) * max(t_i)` (the pipeline's
    latency with `m` microbatches) is chosen by dynamic programming.

    Attributes:
      num_stages: fixes the number of stages; None searches all counts.
      submesh_sizes: allowed device counts of a stage; None allows the
        powers of two up to the device count.
      profile_repeats: timed runs per candidate (the median is used).
    """

    num_stages: int | None = None
    submesh_sizes: tuple[int, ...] | None = None
    profile_repeats: int = 3

    def __post_init__(self):
        if self.num_stages is not None:
            check_positive_int(self.num_stages, "AutoStageOption.num_stages")
        if self.submesh_sizes is not None:
            object.__setattr__(self, "submesh_sizes", tuple(self.submesh_sizes))
            if not self.submesh_sizes:
                raise ValueError("AutoStageOption.submesh_sizes must not be empty.")
            for size in self.submesh_sizes:
                check_positive_int(size, "AutoStageOption.submesh_sizes entry")
        check_positive_int(self.profile_repeats, "AutoStageOption.profile_repeats")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManualStageOption:
    """Stages and their device counts given explicitly.

    Attributes:
      forward_stage_layer_ids: the layers of each stage, e.g. `((0, 1), (2,
        3))`: contiguous, in order, covering every layer exactly once.
      submesh_device_counts: devices of each stage, taken in order from the
        device list; their sum may be below the device count. With
        `virtual_stages=v`, one count per device group: stage `s` runs on
        group `s % len(submesh_device_counts)`.
    """

    forward_stage_layer_ids: tuple[tuple[int, ...], ...]
    submesh_device_counts: tuple[int, ...]

    def __post_init__(self):
        layer_ids = tuple(tuple(stage) for stage in self.forward_stage_layer_ids)
        object.__setattr__(self, "forward_stage_layer_ids", layer_ids)
        object.__setattr__(self, "submesh_device_counts", tuple(self.submesh_device_counts))
        if not layer_ids or any(not stage for stage in layer_ids):
            raise ValueError(
                f"ManualStageOption.forward_stage_layer_ids needs one non-empty group of "
                f"layers per stage, got {layer_ids!r}."
            )
        flat = [layer for stage in layer_ids for layer in stage]
        if flat != list(range(len(flat))):
            raise ValueError(
                f"ManualStageOption.forward_stage_layer_ids must list the layers 0..L-1 in "
                f"order, as contiguous groups (e.g. ((0, 1), (2, 3))); got {layer_ids!r}."
            )
        if not self.submesh_device_counts or len(layer_ids) % len(self.submesh_device_counts):
            raise ValueError(
                f"ManualStageOption has {len(layer_ids)} stages but "
                f"{len(self.submesh_device_counts)} submesh_device_counts; give one per stage "
                "(or, with virtual stages, one per device group)."
            )
        for count in self.submesh_device_counts:
            check_positive_int(count, "ManualStageOption.submesh_device_counts entry")


LayerOption = ManualLayerOption | AutoLayerOption
StageOption = UniformStageOption | AutoStageOption | ManualStageOption


def _layer_option(value: Any) -> LayerOption:
    if value == "manual":
        return ManualLayerOption()
    if isinstance(value, ManualLayerOption | AutoLayerOption):
        return value
    raise ValueError(
        f"PipeshardParallel.layer_option must be 'manual' or AutoLayerOption(layer_num=...), "
        f"got {value!r}."
    )


def _stage_option(value: Any) -> StageOption:
    if value == "uniform":
        return UniformStageOption()
    if value == "auto":
        return AutoStageOption()
    if isinstance(value, UniformStageOption | AutoStageOption | ManualStageOption):
        return value
    raise ValueError(
        f"PipeshardParallel.stage_option must be 'uniform', 'auto', UniformStageOption, "
        f"AutoStageOption or ManualStageOption, got {value!r}."
    )


def _enum_value(enum_type: type[enum.Enum], value: Any, what: str):
    try:
        return enum_type(value)
    except ValueError:
        choices = ", ".join(repr(member.value) for member in enum_type)
        raise ValueError(f"{what} must be one of {choices}, got {value!r}.") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipeshardParallel:
    """Pipeline parallelism across sub-meshes, data parallelism inside each.

    Attributes:
      num_micro_batches: microbatches per step; must divide the batch.
      layer_option: "manual" (cut at `mark_pipeline_boundary()`) or
        `AutoLayerOption(layer_num)`.
      stage_option: "uniform" (one stage per layer), `UniformStageOption`,
        "auto" / `AutoStageOption`, or `ManualStageOption`.
      pipeline_schedule: "gpipe", "1f1b", "interleaved_1f1b" or
        "zero_bubble" (see `PipelineSchedule`).
      virtual_stages: model chunks per device group, for
        "interleaved_1f1b" only: the layers are cut into `stages *
        virtual_stages` stages, stage `c` placed on device group `c % stages`.
      loss_reduction: how the loss reduces over examples ("mean" or "sum").
      time_tasks: wait for every task to finish and record its duration
        (for `plot_schedule(..., timing="measured")` and benchmarks); this
        serializes the stages.
    """

    num_micro_batches: int
    layer_option: LayerOption | str = "manual"
    stage_option: StageOption | str = "uniform"
    pipeline_schedule: PipelineSchedule | str = PipelineSchedule.GPIPE
    virtual_stages: int = 1
    loss_reduction: LossReduction | str = LossReduction.MEAN
    time_tasks: bool = False

    def __post_init__(self):
        check_positive_int(self.num_micro_batches, "PipeshardParallel.num_micro_batches")
        object.__setattr__(self, "layer_option", _layer_option(self.layer_option))
        object.__setattr__(self, "stage_option", _stage_option(self.stage_option))
        schedule = _enum_value(
            PipelineSchedule, self.pipeline_schedule, "PipeshardParallel.pipeline_schedule"
        )
        object.__setattr__(self, "pipeline_schedule", schedule)
        check_positive_int(self.virtual_stages, "PipeshardParallel.virtual_stages")
        if self.virtual_stages > 1 and schedule is not PipelineSchedule.INTERLEAVED_ONE_F_ONE_B:
            raise ValueError(
                f"PipeshardParallel.virtual_stages={self.virtual_stages} needs "
                f"pipeline_schedule='interleaved_1f1b', not {schedule.value!r}; with "
                f"{schedule.value!r} every device group runs one stage (virtual_stages=1)."
            )
        if self.virtual_stages > 1 and isinstance(self.stage_option, AutoStageOption):
            raise ValueError(
                "PipeshardParallel.virtual_stages > 1 needs UniformStageOption or "
                "ManualStageOption: automatic stages place one stage per device group."
            )
        reduction = _enum_value(
            LossReduction, self.loss_reduction, "PipeshardParallel.loss_reduction"
        )
        object.__setattr__(self, "loss_reduction", reduction)
