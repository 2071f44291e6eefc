"""The per-device CSR layout of one stacked table (DESIGN.md section 2).

Everything here is vectorized numpy over the whole host batch of one stacked
table: entries are packed into 64-bit keys (slot, partition, local id,
sample) and sorted once; merging, limits, stats and buffer positions are
segment operations on the sorted keys.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

INT32_MAX = np.iinfo(np.int32).max
ALIGNMENT = 8


class LayoutGeometry(NamedTuple):
    """Static sizes of one stacked table's layout on one host.

    Attributes:
      local_devices: L, devices of this host.
      slots_per_device: S, partitions ("sparse cores") per device.
      num_partitions: N = S * global devices, a power of two.
      rows_per_partition: local rows of the stack's table shard (stack vocab / N).
      samples_per_slot: samples one slot holds over all features of the stack.
      coo_size: buffer entries per device, a multiple of 8 * S.
    """

    local_devices: int
    slots_per_device: int
    num_partitions: int
    rows_per_partition: int
    samples_per_slot: int
    coo_size: int

    @property
    def num_slots(self) -> int:
        return self.local_devices * self.slots_per_device

    @property
    def slot_capacity(self) -> int:
        return self.coo_size // self.slots_per_device

    @property
    def row_pointer_width(self) -> int:
        return max(self.num_partitions, ALIGNMENT)


class Limits(NamedTuple):
    max_ids_per_partition: int
    max_unique_ids_per_partition: int


class StackLayout(NamedTuple):
    """One stacked table's layout and stats for one host batch.

    Attributes:
      row_pointers: `int32[L * S * max(N, 8)]`.
      embedding_ids: `int32[L * coo_size]` local ids (INT32_MAX padding).
      sample_ids: `int32[L * coo_size]` samples in slot (INT32_MAX padding).
      gains: `float32[L * coo_size]` (NaN padding).
      max_ids_per_partition: `int32[L * N]` max over a device's slots.
      max_unique_ids_per_partition: `int32[L * N]`.
      required_buffer_size_per_sc: `int32[L * S]`.
      dropped: entries dropped by limits or buffer size (after merging).
    """

    row_pointers: np.ndarray
    embedding_ids: np.ndarray
    sample_ids: np.ndarray
    gains: np.ndarray
    max_ids_per_partition: np.ndarray
    max_unique_ids_per_partition: np.ndarray
    required_buffer_size_per_sc: np.ndarray
    dropped: int


class LimitBreachError(ValueError):
    """A batch exceeds a table's limits or buffer and dropping is off."""


def _bits(max_value: int) -> int:
    return max(int(max_value).bit_length(), 0)


def _round_up8(x: np.ndarray) -> np.ndarray:
    return (x + (ALIGNMENT - 1)) // ALIGNMENT * ALIGNMENT


class _Sorted(NamedTuple):
    key: np.ndarray  # int64[M] unique (slot, partition, local, sample) keys
    gains: np.ndarray  # float32[M] merged gains


def _sort_and_merge(key: np.ndarray, gains: np.ndarray, key_bits: int) -> _Sorted:
    """Sorts entries by key and sums the gains of equal keys."""
    index_bits = _bits(max(key.size - 1, 0))
    if key_bits + index_bits <= 63:
        # np.sort of one packed array is several times faster than argsort.
        packed = np.sort((key << index_bits) | np.arange(key.size, dtype=np.int64))
        order = packed & ((1 << index_bits) - 1)
        key = packed >> index_bits
    else:
        order = np.argsort(key, kind="stable")
        key = key[order]
    gains = gains[order]
    if key.size == 0:
        return _Sorted(key, gains)
    first = np.empty(key.size, dtype=bool)
    first[0] = True
    np.not_equal(key[1:], key[:-1], out=first[1:])
    if first.all():
        return _Sorted(key, gains)
    starts = np.flatnonzero(first)
    return _Sorted(key[starts], np.add.reduceat(gains, starts))


def _describe_breach(
    table: str, geometry: LayoutGeometry, group: int, what: str, count: int, limit: int
) -> str:
    slot, partition = divmod(group, geometry.num_partitions)
    device, sc = divmod(slot, geometry.slots_per_device)
    return (
        f"Table {table!r}, local device {device}, slot {sc}, partition {partition}: "
        f"{count} {what} exceed the limit of {limit}. Raise the table's limits "
        "(or run the FDO job and apply its stats), or allow id dropping."
    )


def layout_stack(
    *,
    table: str,
    slots: np.ndarray,
    cols: np.ndarray,
    samples: np.ndarray,
    gains: np.ndarray,
    geometry: LayoutGeometry,
    limits: Limits,
    allow_id_dropping: bool,
) -> StackLayout:
    """Lays out one stacked table's entries for the host's devices.

    Args:
      table: stack name, for messages.
      slots: `int64[nnz]` slot `d * S + s` of every entry.
      cols: `int64[nnz]` column in the stacked table.
      samples: `int64[nnz]` sample within its slot.
      gains: `float32[nnz]`.
      geometry: static sizes.
      limits: the stack's per-partition limits.
      allow_id_dropping: drop over-limit entries (counted) instead of raising.

    Returns:
      The layout buffers and the stats (counted after merging, before dropping).

    Raises:
      LimitBreachError: a limit or the buffer is exceeded and dropping is off.
    """
    g = geometry
    n = g.num_partitions
    log_n = n.bit_length() - 1
    sample_bits = _bits(g.samples_per_slot - 1)
    local_bits = _bits(g.rows_per_partition - 1)
    group_shift = local_bits + sample_bits
    key = (
        ((slots << log_n | (cols & (n - 1))) << local_bits | (cols >> log_n)) << sample_bits
    ) | samples
    merged = _sort_and_merge(key, gains, group_shift + log_n + _bits(g.num_slots - 1))
    key = merged.key
    num_groups = g.num_slots * n

    group = key >> group_shift
    counts = np.bincount(group, minlength=num_groups)
    group_start = np.cumsum(counts) - counts
    position = np.arange(key.size, dtype=np.int64) - group_start[group]
    col_key = key >> sample_bits
    new_col = np.empty(key.size, dtype=bool)
    if key.size:
        new_col[0] = True
        np.not_equal(col_key[1:], col_key[:-1], out=new_col[1:])
    unique_counts = np.bincount(group[new_col], minlength=num_groups)
    col_rank = np.cumsum(new_col) - 1 - (np.cumsum(unique_counts) - unique_counts)[group]

    keep = (position < limits.max_ids_per_partition) & (
        col_rank < limits.max_unique_ids_per_partition
    )
    if not allow_id_dropping and not keep.all():
        over_ids = np.flatnonzero(counts > limits.max_ids_per_partition)
        over_unique = np.flatnonzero(unique_counts > limits.max_unique_ids_per_partition)
        if over_ids.size and (not over_unique.size or over_ids[0] <= over_unique[0]):
            gid = int(over_ids[0])
            msg = _describe_breach(
                table, g, gid, "ids", counts[gid], limits.max_ids_per_partition
            )
        else:
            gid = int(over_unique[0])
            msg = _describe_breach(
                table, g, gid, "unique ids", unique_counts[gid],
                limits.max_unique_ids_per_partition,
            )
        raise LimitBreachError(msg)

    # Kept entries are a prefix of their group (both tests are monotone in the
    # position), so `position` is also the position among the kept ones.
    kept = np.bincount(group[keep], minlength=num_groups).reshape(g.num_slots, n)
    aligned = _round_up8(kept)
    starts = np.cumsum(aligned, axis=1) - aligned
    fitting = np.clip(g.slot_capacity - starts, 0, kept)
    if (fitting < kept).any():
        if not allow_id_dropping:
            slot = int(np.argmax((fitting < kept).any(axis=1)))
            raise LimitBreachError(
                f"Table {table!r}, local device {slot // g.slots_per_device}, slot "
                f"{slot % g.slots_per_device}: the batch needs "
                f"{int(aligned[slot].sum())} buffer entries but the slot holds "
                f"{g.slot_capacity} (coo buffer {g.coo_size} per device). Raise "
                "suggested_coo_buffer_size_per_device, or allow id dropping."
            )
        keep &= position < fitting.reshape(-1)[group]
        aligned = _round_up8(fitting)
        starts = np.cumsum(aligned, axis=1) - aligned

    out = np.flatnonzero(keep)
    group_out = group[out]
    slot_out = group_out >> log_n
    pos = slot_out * g.slot_capacity + starts.reshape(-1)[group_out] + position[out]
    size = g.local_devices * g.coo_size
    embedding_ids = np.full(size, INT32_MAX, np.int32)
    sample_ids = np.full(size, INT32_MAX, np.int32)
    out_gains = np.full(size, np.nan, np.float32)
    embedding_ids[pos] = (col_key[out] & ((1 << local_bits) - 1)).astype(np.int32)
    sample_ids[pos] = (key[out] & ((1 << sample_bits) - 1)).astype(np.int32)
    out_gains[pos] = merged.gains[out]

    row_pointers = np.empty((g.num_slots, g.row_pointer_width), np.int32)
    row_pointers[:, :n] = starts + fitting
    row_pointers[:, n:] = aligned.sum(axis=1, keepdims=True)

    per_slot = counts.reshape(g.local_devices, g.slots_per_device, n)
    unique_per_slot = unique_counts.reshape(per_slot.shape)
    return StackLayout(
        row_pointers=row_pointers.reshape(-1),
        embedding_ids=embedding_ids,
        sample_ids=sample_ids,
        gains=out_gains,
        max_ids_per_partition=per_slot.max(axis=1).reshape(-1).astype(np.int32),
        max_unique_ids_per_partition=unique_per_slot.max(axis=1).reshape(-1).astype(np.int32),
        required_buffer_size_per_sc=_round_up8(counts.reshape(g.num_slots, n))
        .sum(axis=1)
        .astype(np.int32),
        dropped=int(key.size - out.size),
    )
