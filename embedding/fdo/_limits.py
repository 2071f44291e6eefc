"""The limits and buffer sizes FDO stats call for, and specs that carry them."""

from __future__ import annotations

import dataclasses
import fractions
import math
from collections.abc import Mapping
from typing import NamedTuple

import jax

from embedding._buffers import INT32_MAX
from embedding._preprocess import SparseDenseMatmulInputStats
from embedding._specs import FeatureSpec, limits_of, round_up
from embedding._stacking import Nested, get_stacked_table_specs, prepare_feature_specs_for_training
from embedding.checks import check_positive_int
from embedding.fdo._file import FdoStats, StackFdoStats
from embedding.fdo._geometry import LIMIT_FIELDS, FdoGeometry


@dataclasses.dataclass(frozen=True, kw_only=True)
class StackLimits:
    """A stacked table's limits, as `StackedTableSpec` holds them.

    Attributes:
      max_ids_per_partition: entries per (slot, partition) and batch.
      max_unique_ids_per_partition: distinct ids per (slot, partition).
      suggested_coo_buffer_size_per_device: buffer entries per device, or
        None for the theoretical maximum.
    """

    max_ids_per_partition: int
    max_unique_ids_per_partition: int
    suggested_coo_buffer_size_per_device: int | None = None

    def __post_init__(self) -> None:
        check_positive_int(self.max_ids_per_partition, "max_ids_per_partition")
        check_positive_int(self.max_unique_ids_per_partition, "max_unique_ids_per_partition")
        if self.suggested_coo_buffer_size_per_device is not None:
            check_positive_int(
                self.suggested_coo_buffer_size_per_device, "suggested_coo_buffer_size_per_device"
            )


class _Margins(NamedTuple):
    """What limits add over an observed count: a factor, and `spread` times
    the count's square root, whichever is more."""

    factor: fractions.Fraction
    spread: float


def _scaled(value: int, margins: _Margins) -> int:
    # Exact arithmetic: 100 * 1.1 in floats rounds up to 111.
    by_headroom = math.ceil(value * margins.factor)
    by_spread = value + math.ceil(margins.spread * math.sqrt(value))
    return max(1, by_headroom, by_spread)


def _margins(headroom: float, spread_margin: float) -> _Margins:
    for name, value in (("headroom", headroom), ("spread_margin", spread_margin)):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{name} must be a number, got {value!r}.")
    if not (math.isfinite(headroom) and headroom >= 1):
        raise ValueError(f"headroom must be a finite number >= 1 (e.g. 1.1), got {headroom!r}.")
    if not (math.isfinite(spread_margin) and spread_margin >= 0):
        raise ValueError(f"spread_margin must be a finite number >= 0, got {spread_margin!r}.")
    return _Margins(fractions.Fraction(repr(float(headroom))), float(spread_margin))


def fdo_limits(
    stats: FdoStats, *, headroom: float = 1.1, spread_margin: float = 4.0
) -> dict[str, StackLimits]:
    """The limits the stats call for, per stacked table.

    `max_ids_per_partition` and `max_unique_ids_per_partition`: the maximum
    over partitions times `headroom`, rounded up; the buffer: the maximum
    required size of a partition slot times S times `headroom`, rounded up
    to a multiple of `8 * S` (as the layout needs). Each is at least the
    observed count plus `spread_margin` times its square root.

    Why the spread margin: a count of ids per partition and batch is a sum of
    many small independent contributions, so it varies from batch to batch
    by about its square root (as a Poisson count does), and the batches
    training draws (shuffled, over many epochs) reach past the ones the stats
    saw. A fixed factor covers that for large counts only: a census column of
    15 values peaked at 16 ids per partition in 10 batches in file order and
    at 19 in 20 shuffled epochs, past the 18 a 1.1 headroom allows
    (`tests/embedding/test_fdo.py`). Repeats of one id cannot be split by
    minibatching. Stats that cover exactly the batches a run draws
    (`FdoStats.batch_order`) need no spread margin (`spread_margin=0`).

    Raises:
      ValueError: a bad headroom, or one that takes a buffer past the int32
        indices of the layout (stats near the largest buffer the geometry
        allows).
    """
    margins = _margins(headroom, spread_margin)
    return {
        name: _stack_limits(name, stack, stats.geometry.partitions_per_device, margins)
        for name, stack in stats.stacks.items()
    }


def _stack_limits(name: str, stack: StackFdoStats, slots: int, margins: _Margins) -> StackLimits:
    buffer = round_up(
        _scaled(int(stack.required_buffer_size_per_sc.max()) * slots, margins), 8 * slots
    )
    # The ids limits stay below the buffer: a partition's ids fit a slot's buffer.
    if buffer > INT32_MAX:
        raise ValueError(
            f"Stack {name!r}: headroom {float(margins.factor):g} and spread margin "
            f"{margins.spread:g} make a buffer of {buffer} entries per device, over the "
            f"{INT32_MAX} int32 indices address; use smaller margins."
        )
    return StackLimits(
        max_ids_per_partition=_scaled(int(stack.max_ids_per_partition.max()), margins),
        max_unique_ids_per_partition=_scaled(
            int(stack.max_unique_ids_per_partition.max()), margins
        ),
        suggested_coo_buffer_size_per_device=buffer,
    )


def batch_fdo_stats(stats: SparseDenseMatmulInputStats, geometry: FdoGeometry) -> FdoStats:
    """One host batch's layout stats as FDO stats (one batch, this host's rows)."""
    stacks = {
        name: StackFdoStats(**{field: getattr(stats, field)[name] for field in LIMIT_FIELDS})
        for name in stats.max_ids_per_partition
    }
    return FdoStats(config_hash="", geometry=geometry, batches=1, stacks=stacks)


def exceeds(needed: StackLimits, limits: StackLimits) -> bool:
    """Whether limits `needed` exactly (`fdo_limits` at headroom 1, no margin) pass `limits`."""
    buffer = limits.suggested_coo_buffer_size_per_device
    return (
        needed.max_ids_per_partition > limits.max_ids_per_partition
        or needed.max_unique_ids_per_partition > limits.max_unique_ids_per_partition
        or (buffer is not None and needed.suggested_coo_buffer_size_per_device > buffer)
    )


def max_limits(a: StackLimits, b: StackLimits) -> StackLimits:
    """The larger of each limit (a buffer of None, the largest, stays None)."""
    buffers = (a.suggested_coo_buffer_size_per_device, b.suggested_coo_buffer_size_per_device)
    return StackLimits(
        max_ids_per_partition=max(a.max_ids_per_partition, b.max_ids_per_partition),
        max_unique_ids_per_partition=max(
            a.max_unique_ids_per_partition, b.max_unique_ids_per_partition
        ),
        suggested_coo_buffer_size_per_device=None if None in buffers else max(buffers),
    )


def stack_limits(feature_specs: Nested) -> dict[str, StackLimits]:
    """The limits the prepared specs' stacked tables carry, per stack."""
    return {
        name: StackLimits(**limits_of(stack))
        for name, stack in get_stacked_table_specs(feature_specs).items()
    }


def set_stack_limits(
    feature_specs: Nested,
    limits: Mapping[str, StackLimits],
    *,
    global_device_count: int,
    num_sc_per_device: int,
) -> Nested:
    """Prepared specs whose named stacked tables carry the given limits.

    Args:
      feature_specs: a pytree of `FeatureSpec` (prepared or not).
      limits: per stack name; stacks not named keep their limits.
      global_device_count: G, typically `mesh.size`.
      num_sc_per_device: S.

    Returns:
      The same pytree, prepared, with new `StackedTableSpec`s.

    Raises:
      ValueError: `limits` names a stack the specs do not have.
    """
    prepared = prepare_feature_specs_for_training(
        feature_specs, global_device_count, num_sc_per_device
    )
    stacks = get_stacked_table_specs(prepared)
    unknown = sorted(set(limits) - set(stacks))
    if unknown:
        raise ValueError(
            f"Limits for unknown stacked tables {unknown}; the specs have {sorted(stacks)}."
        )
    new = {
        name: dataclasses.replace(stacks[name], **dataclasses.asdict(limit))
        for name, limit in limits.items()
    }

    def replace(feature: FeatureSpec) -> FeatureSpec:
        stacked = new.get(feature.table_spec.stacked_table_spec.stack_name)
        if stacked is None:
            return feature
        table = dataclasses.replace(feature.table_spec, stacked_table_spec=stacked)
        return dataclasses.replace(feature, table_spec=table)

    return jax.tree.map(replace, prepared)


def apply_fdo(
    feature_specs: Nested, stats: FdoStats, *, headroom: float = 1.1, spread_margin: float = 4.0
) -> Nested:
    """Prepared specs with every stacked table's limits and buffer set from stats.

    Args:
      feature_specs: a pytree of `FeatureSpec` (prepared or not) of the run
        the stats were computed for.
      stats: e.g. from `load_fdo_stats` or `FdoClient.load`.
      headroom: factor >= 1 over the observed maxima (see `fdo_limits`).
      spread_margin: square roots of an observed maximum added at least
        (see `fdo_limits`); 0 for limits exactly at the maxima.

    Returns:
      The same pytree, prepared for the stats' geometry, with new
      `StackedTableSpec`s (the inputs are not changed).

    Raises:
      ValueError: the stats' stacked tables differ from the specs'.

    Example:
      stats = embedding.load_fdo_stats(directory, expected_config_hash=h,
                                       expected_geometry=g)
      specs = embedding.apply_fdo(specs, stats, headroom=1.2)
    """
    geometry = stats.geometry
    prepared = prepare_feature_specs_for_training(
        feature_specs, geometry.devices, geometry.partitions_per_device
    )
    stacks = set(get_stacked_table_specs(prepared))
    if stacks != set(stats.stacks):
        raise ValueError(
            f"The FDO stats are for stacked tables {sorted(stats.stacks)}, the specs have "
            f"{sorted(stacks)}; recompute the stats for this config."
        )
    return set_stack_limits(
        prepared,
        fdo_limits(stats, headroom=headroom, spread_margin=spread_margin),
        global_device_count=geometry.devices,
        num_sc_per_device=geometry.partitions_per_device,
    )
