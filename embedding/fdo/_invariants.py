"""What the stats of one stacked table satisfy when they are consistent.

The bounds follow from how the layout counts (`embedding._layout`). In a
batch, slot s of local device d sends `count[d, s, p]` ids, `unique[d, s, p]`
of them distinct, to partition p, and the stats are

  max_ids_per_partition[d * N + p]        = max over s of count[d, s, p]
  max_unique_ids_per_partition[d * N + p] = max over s of unique[d, s, p]
  required_buffer_size_per_sc[d * S + s]  = sum over p of roundup8(count[d, s, p])

so a buffer is a multiple of 8, distinct ids never outnumber ids, and a
partition's ids never exceed the largest buffer of its device's slots.
Element-wise maxima over batches and hosts keep all three.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import numpy as np

from embedding._buffers import INT32_MAX
from embedding.fdo._geometry import FdoGeometry, largest_slot_buffer, stat_sizes
from embedding.fdo._schema import SchemaError, field, item

BATCH_MAX_PERCENTILES = ("p50", "p90", "p99", "p99.9", "max")
"""The percentiles of a stat's per-batch maxima an offline stats file holds, in order."""


def check_stack(
    entry: str,
    geometry: FdoGeometry,
    batches: int,
    *,
    max_ids_per_partition: np.ndarray,
    max_unique_ids_per_partition: np.ndarray,
    required_buffer_size_per_sc: np.ndarray,
    batch_max_percentiles: Mapping[str, Mapping[str, int]] | None,
    partition_histogram: np.ndarray | None,
) -> None:
    """Checks one stacked table's stats (see `StackFdoStats`) against each other.

    Args:
      entry: the stack's name in messages, e.g. `stacks['t']`.
      geometry: the geometry the stats are for.
      batches: global batches the stats cover.

    Raises:
      SchemaError: an array of the wrong shape or a value out of bounds,
        naming the entry.
    """
    stats = {
        "max_ids_per_partition": max_ids_per_partition,
        "max_unique_ids_per_partition": max_unique_ids_per_partition,
        "required_buffer_size_per_sc": required_buffer_size_per_sc,
    }
    for name, size in stat_sizes(geometry).items():
        if stats[name].shape != (size,):
            raise SchemaError(
                field(entry, name),
                f"has shape {stats[name].shape}, expected ({size},) for {geometry}",
            )
    _check_buffers(entry, geometry, required_buffer_size_per_sc)
    _check_ids(entry, geometry, stats)
    if batch_max_percentiles is not None:
        _check_percentiles(field(entry, "batch_max_percentiles"), batch_max_percentiles, stats)
    if partition_histogram is not None:
        partition_max = max_ids_per_partition.reshape(geometry.local_devices, -1).max(axis=0)
        _check_histogram(
            field(entry, "partition_histogram"), partition_histogram, partition_max, batches
        )


def _first(mask: np.ndarray) -> int | None:
    found = np.flatnonzero(mask)
    return int(found[0]) if found.size else None


def _check_buffers(entry: str, geometry: FdoGeometry, required: np.ndarray) -> None:
    where = field(entry, "required_buffer_size_per_sc")
    i = _first(required % 8)
    if i is not None:
        raise SchemaError(item(where, i), f"{required[i]} is not a multiple of 8")
    i = _first(required > largest_slot_buffer(geometry))
    if i is not None:
        slots = geometry.partitions_per_device
        raise SchemaError(
            item(where, i),
            f"{required[i]} entries per slot take {int(required[i]) * slots} per device "
            f"({slots} slots), over the {INT32_MAX} int32 indices address",
        )


def _check_ids(entry: str, geometry: FdoGeometry, stats: Mapping[str, np.ndarray]) -> None:
    ids, unique = stats["max_ids_per_partition"], stats["max_unique_ids_per_partition"]
    slot_buffers = stats["required_buffer_size_per_sc"].reshape(geometry.local_devices, -1)
    device_buffer = np.repeat(slot_buffers.max(axis=1), geometry.num_partitions)
    i = _first(ids > device_buffer)
    if i is not None:
        raise SchemaError(
            item(field(entry, "max_ids_per_partition"), i),
            f"{ids[i]} ids exceed the largest buffer of local device "
            f"{i // geometry.num_partitions}'s slots, {device_buffer[i]}",
        )
    i = _first(unique > ids)
    if i is not None:
        raise SchemaError(
            item(field(entry, "max_unique_ids_per_partition"), i),
            f"{unique[i]} distinct ids exceed the {ids[i]} ids of max_ids_per_partition[{i}]",
        )


def _check_percentiles(
    where: str, percentiles: Mapping[str, Mapping[str, int]], stats: Mapping[str, np.ndarray]
) -> None:
    for stat, values in percentiles.items():
        if stat not in stats:
            raise SchemaError(where, f"unknown entry {stat!r}")
        here = item(where, stat)
        if sorted(values) != sorted(BATCH_MAX_PERCENTILES):
            raise SchemaError(here, f"must hold {', '.join(BATCH_MAX_PERCENTILES)}")
        for low, high in itertools.pairwise(BATCH_MAX_PERCENTILES):
            if values[high] < values[low]:
                raise SchemaError(here, f"{high} {values[high]} is below {low} {values[low]}")
        largest = int(stats[stat].max(initial=0))
        if values["max"] != largest:
            raise SchemaError(here, f"max {values['max']} is not the largest {stat}, {largest}")


def _check_histogram(
    where: str, histogram: np.ndarray, partition_max: np.ndarray, batches: int
) -> None:
    if histogram.ndim != 2 or histogram.shape[0] != partition_max.size:
        raise SchemaError(
            where, f"has shape {histogram.shape}, expected ({partition_max.size}, values)"
        )
    # Every batch adds one count to every partition's row.
    totals = histogram.sum(axis=1)
    p = _first(totals != batches)
    if p is not None:
        raise SchemaError(
            where, f"partition {p} counts {totals[p]} batches, the stats cover {batches}"
        )
    took = _largest_counted(histogram)
    p = _first(took > partition_max)
    if p is not None:
        raise SchemaError(
            where,
            f"partition {p} took {took[p]} ids in a batch, more than its "
            f"max_ids_per_partition, {partition_max[p]}",
        )


def _largest_counted(histogram: np.ndarray) -> np.ndarray:
    """Per row, the largest value with a count; -1 for a row without one."""
    counted = histogram > 0
    if not counted.size:
        return np.full(histogram.shape[0], -1)
    last = histogram.shape[1] - 1 - np.argmax(counted[:, ::-1], axis=1)
    return np.where(counted.any(axis=1), last, -1)
