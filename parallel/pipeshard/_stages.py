"""Stage construction: layers into stages, devices into one sub-mesh each."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from parallel.pipeshard._options import (
    AutoStageOption,
    ManualStageOption,
    StageOption,
    UniformStageOption,
)

logger = logging.getLogger(__name__)

DATA_AXIS = "data"

StageTimer = Callable[[int, int, int], float]
"""`timer(first_layer, last_layer, num_devices) -> seconds` for one microbatch."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagePlan:
    """Which layers each stage runs, on how many devices.

    Attributes:
      stage_layer_ids: per stage, its contiguous layers.
      device_counts: per device group, the size of its sub-mesh.
      virtual_stages: stages per device group; stage `s` runs on group
        `s % len(device_counts)` (interleaved schedules).
    """

    stage_layer_ids: tuple[tuple[int, ...], ...]
    device_counts: tuple[int, ...]
    virtual_stages: int = 1

    @property
    def num_stages(self) -> int:
        return len(self.stage_layer_ids)

    @property
    def num_groups(self) -> int:
        """Device groups: `num_stages / virtual_stages`."""
        return len(self.device_counts)

    @property
    def stage_of_layer(self) -> tuple[int, ...]:
        return tuple(s for s, layers in enumerate(self.stage_layer_ids) for _ in layers)


def construct_stages(
    option: StageOption,
    *,
    num_layers: int,
    num_devices: int,
    num_microbatches: int,
    timer: StageTimer | None,
    virtual_stages: int = 1,
) -> StagePlan:
    """Groups `num_layers` layers into stages over `num_devices` devices.

    Args:
      option: how to group.
      num_layers: layers of the model.
      num_devices: devices to slice.
      num_microbatches: m, weighting the slowest stage in the automatic search.
      timer: measures a candidate stage; needed by `AutoStageOption` only.
      virtual_stages: v; the option's stages are device groups, each running
        v stages (for `ManualStageOption`, its layer groups are the stages
        and its device counts the groups).

    Raises:
      ValueError: more stages than devices or layers, a stage count that
        does not divide the layers, or manual stages that do not match.
    """
    if isinstance(option, UniformStageOption):
        return _uniform(option, num_layers, num_devices, virtual_stages)
    if isinstance(option, ManualStageOption):
        return _manual(option, num_layers, num_devices, virtual_stages)
    if isinstance(option, AutoStageOption):
        return _auto(option, num_layers, num_devices, num_microbatches, timer)
    raise TypeError(f"Unknown stage option {option!r}.")


def _check_stage_count(num_stages: int, num_layers: int, num_devices: int) -> None:
    if num_stages > num_devices:
        raise ValueError(
            f"The pipeline has {num_stages} stages but only {num_devices} devices; every "
            f"stage needs at least one device. Use at most {num_devices} stages (fewer "
            "markers, a smaller AutoLayerOption.layer_num or UniformStageOption(num_stages)) "
            "or more devices."
        )
    if num_stages > num_layers:
        raise ValueError(
            f"{num_stages} stages were asked for but the model has only {num_layers} layers; "
            f"use at most {num_layers} stages or cut more layers."
        )


def _uniform(option: UniformStageOption, num_layers: int, num_devices: int, v: int) -> StagePlan:
    if option.num_stages is None and num_layers % v:
        raise ValueError(
            f"virtual_stages={v} must divide the {num_layers} layers when "
            "UniformStageOption gives one stage per layer; set UniformStageOption.num_stages."
        )
    num_groups = option.num_stages or num_layers // v
    num_stages = num_groups * v
    _check_stage_count(num_groups, num_layers, num_devices)
    if num_layers % num_stages:
        raise ValueError(
            f"UniformStageOption(num_stages={num_groups}) with virtual_stages={v} must divide "
            f"the {num_layers} layers evenly into {num_stages} stages; choose a divisor or use "
            "ManualStageOption."
        )
    per_stage = num_layers // num_stages
    layer_ids = tuple(tuple(range(s * per_stage, (s + 1) * per_stage)) for s in range(num_stages))
    base, extra = divmod(num_devices, num_groups)
    counts = tuple(base + (s < extra) for s in range(num_groups))
    return StagePlan(stage_layer_ids=layer_ids, device_counts=counts, virtual_stages=v)


def _manual(option: ManualStageOption, num_layers: int, num_devices: int, v: int) -> StagePlan:
    num_stages = len(option.forward_stage_layer_ids)
    if len(option.submesh_device_counts) * v != num_stages:
        raise ValueError(
            f"ManualStageOption lists {num_stages} layer groups and "
            f"{len(option.submesh_device_counts)} device counts; with virtual_stages={v} "
            f"give {v} layer groups per device count."
        )
    _check_stage_count(num_stages // v, num_layers, num_devices)
    used = sum(option.forward_stage_layer_ids, ())
    if len(used) != num_layers:
        raise ValueError(
            f"ManualStageOption covers layers 0..{len(used) - 1} but the model has "
            f"{num_layers} layers; list every layer exactly once."
        )
    if sum(option.submesh_device_counts) > num_devices:
        raise ValueError(
            f"ManualStageOption.submesh_device_counts {option.submesh_device_counts} need "
            f"{sum(option.submesh_device_counts)} devices but only {num_devices} exist."
        )
    return StagePlan(
        stage_layer_ids=option.forward_stage_layer_ids,
        device_counts=option.submesh_device_counts,
        virtual_stages=v,
    )


def _auto(
    option: AutoStageOption, num_layers: int, num_devices: int, m: int, timer: StageTimer
) -> StagePlan:
    sizes = option.submesh_sizes or tuple(
        2**k for k in range(num_devices.bit_length()) if 2**k <= num_devices
    )
    sizes = tuple(sorted({s for s in sizes if s <= num_devices}))
    if option.num_stages:
        _check_stage_count(option.num_stages, num_layers, num_devices)
    times = {
        (i, j, d): timer(i, j, d)
        for i, j in itertools.combinations_with_replacement(range(num_layers), 2)
        for d in sizes
    }
    best = _best_partition(times, num_layers, num_devices, sizes, m, option.num_stages)
    if best is None:
        raise ValueError(
            f"No split of {num_layers} layers over {num_devices} devices with sub-mesh sizes "
            f"{sizes}"
            + (f" into {option.num_stages} stages" if option.num_stages else "")
            + " uses every device; allow other AutoStageOption.submesh_sizes."
        )
    logger.info("Automatic stages: %s", best)
    return best


def _best_partition(times, num_layers, num_devices, sizes, m, num_stages) -> StagePlan | None:
    """Minimizes sum(t) + (m - 1) max(t) over partitions using every device.

    For each candidate bound on the slowest stage, a dynamic program finds
    the partition with the least total time whose stages all respect it.
    """
    best_cost, best_plan = np.inf, None
    for bound in sorted(set(times.values())):
        plan = _least_total_time(times, num_layers, num_devices, sizes, bound, num_stages)
        if plan is None:
            continue
        total, stages = plan
        cost = total + (m - 1) * max(times[s] for s in stages)
        if cost < best_cost:
            best_cost = cost
            best_plan = StagePlan(
                stage_layer_ids=tuple(tuple(range(i, j + 1)) for i, j, _ in stages),
                device_counts=tuple(d for _, _, d in stages),
            )
    return best_plan


def _least_total_time(times, num_layers, num_devices, sizes, bound, num_stages):
    # table[(layers done, devices used, stages)] = (total time, stages)
    table = {(0, 0, 0): (0.0, ())}
    for done in range(num_layers):
        for (layers, used, count), (total, stages) in sorted(table.items()):
            if layers != done:
                continue
            for last, size in itertools.product(range(done, num_layers), sizes):
                t = times[(done, last, size)]
                key = (last + 1, used + size, count + 1)
                if t > bound or used + size > num_devices:
                    continue
                if key not in table or total + t < table[key][0]:
                    table[key] = (total + t, (*stages, (done, last, size)))
    finals = [
        value
        for (layers, used, count), value in table.items()
        if layers == num_layers and used == num_devices and (not num_stages or count == num_stages)
    ]
    return min(finals, default=None)


def slice_devices(devices: Sequence[jax.Device], plan: StagePlan) -> tuple[Mesh, ...]:
    """The 1-D data-parallel mesh of every stage, one per group of consecutive devices."""
    groups, offset = [], 0
    for count in plan.device_counts:
        groups.append(Mesh(np.array(devices[offset : offset + count]), (DATA_AXIS,)))
        offset += count
    return tuple(groups[s % plan.num_groups] for s in range(plan.num_stages))
