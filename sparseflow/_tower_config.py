"""The `model.tower` and `model.pipeshard` sub-sections of the config.

    model:
      tower: {type: dcn_v2, cross_layers: 3, mlp: [64, 32]}   # default: dlrm
      pipeshard: {stages: 2, microbatches: 4, schedule: 1f1b, layers: manual}

Each reader takes the sub-section's config node (its `value`, `child(key)`
and `error(message)`) and returns a frozen dataclass; a bad entry raises
the node's error, naming the entry.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from embedding.checks import check_positive_int
from parallel.pipeshard import PipelineSchedule

LAYER_CHOICES = ("manual", "auto")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DcnV2Tower:
    """DCN-v2: full-rank cross layers over [dense tower output, embeddings], then an MLP.

    Attributes:
      cross_layers: K; layer l computes `x0 * (x_l W_l + b_l) + x_l`.
      mlp: hidden widths after the cross layers (a final width-1 layer is added).
    """

    cross_layers: int = 2
    mlp: tuple[int, ...] = (64, 32)

    def __post_init__(self) -> None:
        check_positive_int(self.cross_layers, "model.tower.cross_layers")
        object.__setattr__(self, "mlp", tuple(self.mlp))
        for width in self.mlp:
            check_positive_int(width, "model.tower.mlp entries")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipeshardConfig:
    """The dense tower run as a pipeshard pipeline inside SC/TC pipelined training.

    Attributes:
      stages: p, device groups (the devices are split evenly among them).
      microbatches: m per global batch.
      schedule: the pipeline schedule.
      layers: "manual" (the tower's own layer boundaries) or "auto" (cut
        by FLOPs into `stages * virtual_stages` layers).
      virtual_stages: v, for the interleaved schedule.
    """

    stages: int
    microbatches: int
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    layers: str = "manual"
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        check_positive_int(self.stages, "model.pipeshard.stages")
        check_positive_int(self.microbatches, "model.pipeshard.microbatches")
        check_positive_int(self.virtual_stages, "model.pipeshard.virtual_stages")
        object.__setattr__(self, "schedule", PipelineSchedule(self.schedule))
        if self.layers not in LAYER_CHOICES:
            raise ValueError(f"model.pipeshard.layers must be manual or auto, got {self.layers!r}")
        interleaved = self.schedule is PipelineSchedule.INTERLEAVED_ONE_F_ONE_B
        if self.virtual_stages > 1 and not interleaved:
            raise ValueError("model.pipeshard.virtual_stages > 1 needs schedule: interleaved_1f1b")


def _fields(node, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> dict:
    if not isinstance(node.value, dict):
        raise node.error(f"expected a mapping, got {type(node.value).__name__}")
    for key in node.value:
        if key not in allowed:
            raise node.child(key).error(f"unknown key; known keys: {', '.join(allowed)}")
    for key in required:
        if key not in node.value:
            raise node.error(f"missing required key {key!r}")
    return dict(node.value)


def _built(node, cls: type, values: dict) -> Any:
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise node.error(str(e)) from e


def read_pipeshard(node) -> PipeshardConfig:
    """`model.pipeshard`: `{stages, microbatches, schedule, layers, virtual_stages}`."""
    values = _fields(
        node,
        ("stages", "microbatches", "schedule", "layers", "virtual_stages"),
        ("stages", "microbatches"),
    )
    if "schedule" in values:
        choices = [s.value for s in PipelineSchedule]
        if values["schedule"] not in choices:
            raise node.child("schedule").error(
                f"unknown schedule {values['schedule']!r}; choose one of: {', '.join(choices)}"
            )
    return _built(node, PipeshardConfig, values)


def read_tower(node) -> str | DcnV2Tower:
    """`model.tower`: `{type: dlrm}` (the default) or `{type: dcn_v2, cross_layers, mlp}`."""
    values = _fields(node, ("type", "cross_layers", "mlp"), ("type",))
    kind = values.pop("type")
    if kind == "dlrm":
        if values:
            raise node.error(f"type dlrm takes no {', '.join(values)}; set model.bottom/top_mlp")
        return "dlrm"
    if kind != "dcn_v2":
        raise node.child("type").error(f"unknown tower {kind!r}; choose one of: dlrm, dcn_v2")
    if "mlp" in values and not isinstance(values["mlp"], list):
        raise node.child("mlp").error("expected a list of widths")
    return _built(node, DcnV2Tower, values)
