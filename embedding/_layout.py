"""The per-device CSR layout of one stacked table (DESIGN.md section 2).

Entries of the whole host batch of one stacked table are packed into 64-bit
keys (slot, partition, local id, sample) and sorted once; merging, limits and
the buffer scatter are one compiled pass over the sorted keys, and the stats
and row pointers are numpy over the small per-(slot, partition) counts.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from embedding._layout_kernel import pack_feature_keys, scan_sorted_entries

INT32_MAX = np.iinfo(np.int32).max
ALIGNMENT = 8
_NO_GAINS = np.ones(1, np.float32)


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


def _where(geometry: LayoutGeometry, group: int) -> str:
    slot, partition = divmod(group, geometry.num_partitions)
    device, sc = divmod(slot, geometry.slots_per_device)
    return f"local device {device}, slot {sc}, partition {partition}"


def _breach_message(
    table: str,
    geometry: LayoutGeometry,
    limits: Limits,
    counts: np.ndarray,
    unique_counts: np.ndarray,
    kept: np.ndarray,
) -> str:
    """Names the first (slot, partition) whose entries were not all kept."""
    group = int(np.argmax(kept < counts))
    fix = "Raise the table's limits (or apply FDO stats), or allow id dropping."
    if counts[group] > limits.max_ids_per_partition:
        return (
            f"Table {table!r}, {_where(geometry, group)}: {counts[group]} ids exceed "
            f"max_ids_per_partition = {limits.max_ids_per_partition}. {fix}"
        )
    if unique_counts[group] > limits.max_unique_ids_per_partition:
        return (
            f"Table {table!r}, {_where(geometry, group)}: {unique_counts[group]} unique "
            "ids exceed max_unique_ids_per_partition = "
            f"{limits.max_unique_ids_per_partition}. {fix}"
        )
    return (
        f"Table {table!r}, {_where(geometry, group)}: the slot's buffer of "
        f"{geometry.slot_capacity} entries (coo buffer {geometry.coo_size} per device) "
        "is too small for this batch. Raise suggested_coo_buffer_size_per_device, "
        "or allow id dropping."
    )


class StackMember(NamedTuple):
    """One feature's flat input and its place in the stack.

    Attributes:
      ids: `int[nnz]` ids, in range.
      row_splits: `int64[rows + 1]`.
      gains: `float32[nnz]`, or None for all ones.
      samples_per_slot: the feature's rows per slot.
      sample_offset: samples of earlier features of the stack in each slot.
      col_shift: shard rotation of the feature's table.
      col_offset: `row_offset_in_shard * N` of the feature's table.
    """

    ids: np.ndarray
    row_splits: np.ndarray
    gains: np.ndarray | None
    samples_per_slot: int
    sample_offset: int
    col_shift: int
    col_offset: int


def _sorted_keys(members, geometry: LayoutGeometry, local_bits: int, sample_bits: int):
    """`(int64[nnz] sorted packed keys, index bits)` of all members' entries."""
    g = geometry
    log_n = g.num_partitions.bit_length() - 1
    nnz = sum(m.ids.size for m in members)
    index_bits = max(_bits(nnz - 1), 1)
    key_bits = _bits(g.num_slots - 1) + log_n + local_bits + sample_bits
    if key_bits + index_bits > 63:
        raise ValueError(
            f"The layout key needs {key_bits + index_bits} bits (> 63): too many "
            "slots, rows per partition, samples per slot or ids in one batch."
        )
    packed = np.empty(nnz, np.int64)
    base = 0
    for m in members:
        pack_feature_keys(
            m.ids,
            m.row_splits,
            m.samples_per_slot,
            m.sample_offset,
            m.col_shift,
            m.col_offset,
            log_n,
            local_bits,
            sample_bits,
            index_bits,
            base,
            packed[base : base + m.ids.size],
        )
        base += m.ids.size
    # Sorting the packed keys carries each entry's original index along; it is
    # several times faster than an argsort.
    packed.sort()
    return packed, index_bits


def _member_gains(members) -> np.ndarray | None:
    if all(m.gains is None for m in members):
        return None
    return np.concatenate(
        [
            np.ones(m.ids.size, np.float32) if m.gains is None else m.gains
            for m in members
        ]
    )


def layout_stack(
    *,
    table: str,
    members: list[StackMember],
    geometry: LayoutGeometry,
    limits: Limits,
    allow_id_dropping: bool,
) -> StackLayout:
    """Lays out one stacked table's entries for the host's devices.

    Args:
      table: stack name, for messages.
      members: the stack's features, in stacking order.
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
    packed, index_bits = _sorted_keys(members, g, local_bits, sample_bits)
    gains = _member_gains(members)
    size = g.local_devices * g.coo_size
    embedding_ids = np.full(size, INT32_MAX, np.int32)
    sample_ids = np.full(size, INT32_MAX, np.int32)
    out_gains = np.full(size, np.nan, np.float32)
    counts, unique_counts, kept = scan_sorted_entries(
        packed,
        index_bits,
        _NO_GAINS if gains is None else gains,
        gains is None,
        local_bits + sample_bits,
        sample_bits,
        local_bits,
        log_n,
        g.num_slots * n,
        g.slot_capacity,
        limits.max_ids_per_partition,
        limits.max_unique_ids_per_partition,
        embedding_ids,
        sample_ids,
        out_gains,
    )
    dropped = int(counts.sum() - kept.sum())
    if dropped and not allow_id_dropping:
        raise LimitBreachError(
            _breach_message(table, g, limits, counts, unique_counts, kept)
        )

    kept = kept.reshape(g.num_slots, n)
    aligned = _round_up8(kept)
    row_pointers = np.empty((g.num_slots, g.row_pointer_width), np.int32)
    row_pointers[:, :n] = np.cumsum(aligned, axis=1) - aligned + kept
    row_pointers[:, n:] = aligned.sum(axis=1, keepdims=True)

    per_slot = counts.reshape(g.local_devices, g.slots_per_device, n)
    unique_per_slot = unique_counts.reshape(per_slot.shape)
    return StackLayout(
        row_pointers=row_pointers.reshape(-1),
        embedding_ids=embedding_ids,
        sample_ids=sample_ids,
        gains=out_gains,
        max_ids_per_partition=per_slot.max(axis=1).reshape(-1).astype(np.int32),
        max_unique_ids_per_partition=unique_per_slot.max(axis=1)
        .reshape(-1)
        .astype(np.int32),
        required_buffer_size_per_sc=_round_up8(counts.reshape(g.num_slots, n))
        .sum(axis=1)
        .astype(np.int32),
        dropped=dropped,
    )
