"""The per-device CSR layout of one stacked table (docs/design.md section 2).

Entries of the whole host batch of one stacked table are packed into 64-bit
keys (slot, partition, local id, sample) and sorted once (a radix sort of the
fields not already in order); merging, limits and
the buffer scatter are one compiled pass over the sorted keys, and the stats
and row pointers are numpy over the small per-(slot, partition) counts.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from embedding._buffers import BufferPool, aligned_empty
from embedding._errors import SparseflowError
from embedding._layout_kernel import pack_feature_keys, scan_sorted_entries, stable_sort_by_bits
from embedding._minibatch import BUCKET_BITS, add_minibatch_to_keys, count_buckets, split_mask

ALIGNMENT = 8
_NO_GAINS = np.ones(1, np.float32)
_BUFFERS = BufferPool()


class LayoutGeometry(NamedTuple):
    """Static sizes of one stacked table's layout on one host.

    Attributes:
      local_devices: L, devices of this host.
      slots_per_device: S, partitions ("sparse cores") per device.
      num_partitions: N = S * global devices, a power of two.
      rows_per_partition: local rows of the stack's table shard (stack vocab / N).
      samples_per_slot: samples one slot holds over all features of the stack.
      coo_size: buffer entries per device, a multiple of 8 * S.
      max_minibatches: 64 when minibatching is enabled (row pointers for every
        possible minibatch), else 1.
    """

    local_devices: int
    slots_per_device: int
    num_partitions: int
    rows_per_partition: int
    samples_per_slot: int
    coo_size: int
    max_minibatches: int = 1

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
      row_pointers: `int32[L * S * max_minibatches * max(N, 8)]`: per slot and
        minibatch, the partitions' segment ends relative to the slot start.
      embedding_ids: `int32[L * coo_size]` local ids (INT32_MAX padding).
      sample_ids: `int32[L * coo_size]` samples in slot (INT32_MAX padding).
      gains: `float32[L * coo_size]` (NaN padding).
      max_ids_per_partition: `int32[L * N]` max over a device's slots.
      max_unique_ids_per_partition: `int32[L * N]`.
      required_buffer_size_per_sc: `int32[L * S]`.
      dropped: input ids dropped by limits or buffer size, every occurrence
        of a merged entry counted (as jax-tpu-embedding counts them).
      num_minibatches: minibatches the layout holds (1 without minibatching).
    """

    row_pointers: np.ndarray
    embedding_ids: np.ndarray
    sample_ids: np.ndarray
    gains: np.ndarray
    max_ids_per_partition: np.ndarray
    max_unique_ids_per_partition: np.ndarray
    required_buffer_size_per_sc: np.ndarray
    dropped: int
    num_minibatches: int = 1


class LimitBreachError(SparseflowError, ValueError):
    """A batch exceeds a table's limits or buffer and dropping is off.

    Attributes:
      batch_number: the global batch, where the input pipeline knows it
        (`pipelines` sets it; it survives pickling from a worker process),
        else None.
    """

    batch_number: int | None = None


def _bits(max_value: int) -> int:
    return max(int(max_value).bit_length(), 0)


def _round_up8(x: np.ndarray) -> np.ndarray:
    return (x + (ALIGNMENT - 1)) // ALIGNMENT * ALIGNMENT


def _aligned_full(size: int, value, dtype) -> np.ndarray:
    out = aligned_empty(size, dtype)
    out.fill(value)
    return out


def _where(geometry: LayoutGeometry, group: int, minibatched: bool) -> str:
    rest, partition = divmod(group, geometry.num_partitions)
    slot, minibatch = divmod(rest, geometry.max_minibatches) if minibatched else (rest, 0)
    device, sc = divmod(slot, geometry.slots_per_device)
    where = f"local device {device}, slot {sc}, partition {partition}"
    return f"{where}, minibatch {minibatch}" if minibatched else where


def _breach_message(
    table: str,
    geometry: LayoutGeometry,
    limits: Limits,
    counts: np.ndarray,
    unique_counts: np.ndarray,
    kept: np.ndarray,
    minibatches: np.ndarray | None,
) -> str:
    """Names the first (slot, partition) whose entries were not all kept."""
    group = int(np.argmax(kept < counts))
    where = f"Table {table!r}, {_where(geometry, group, minibatches is not None)}"
    fix = "Raise the table's limits (or apply FDO stats), or allow id dropping."
    if minibatches is not None:
        fix = "One minibatching bucket alone exceeds the limit; raise the limits. " + fix
    if counts[group] > limits.max_ids_per_partition:
        return (
            f"{where}: {counts[group]} ids exceed max_ids_per_partition = "
            f"{limits.max_ids_per_partition}. {fix}"
        )
    if unique_counts[group] > limits.max_unique_ids_per_partition:
        return (
            f"{where}: {unique_counts[group]} unique ids exceed "
            f"max_unique_ids_per_partition = {limits.max_unique_ids_per_partition}. {fix}"
        )
    return (
        f"{where}: the slot's buffer of {geometry.slot_capacity} entries (coo buffer "
        f"{geometry.coo_size} per device) is too small for this batch. Raise "
        "suggested_coo_buffer_size_per_device, or allow id dropping."
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


class SortedStack(NamedTuple):
    """One stack's entries as sorted packed keys.

    Attributes:
      packed: `int64[nnz]` sorted `key << index_bits | original index`, key =
        (slot, partition, local id, sample).
      index_bits: bits of the original index (0 when `gains` is None).
      gains: `float32[nnz]` in original order, or None for all ones.
      local_bits: bits of the local id.
      sample_bits: bits of the sample.
    """

    packed: np.ndarray
    index_bits: int
    gains: np.ndarray | None
    local_bits: int
    sample_bits: int

    @property
    def group_shift(self) -> int:
        return self.local_bits + self.sample_bits

    def key_fields(self, partition_bits: int) -> tuple[np.ndarray, int, int, int, int, int]:
        """`(packed, index_bits, group_shift, sample_bits, local_bits, partition_bits)`:
        the keys and the widths of their fields, the leading arguments of the
        minibatching kernels (`count_buckets`, `add_minibatch_to_keys`)."""
        return (
            self.packed,
            self.index_bits,
            self.group_shift,
            self.sample_bits,
            self.local_bits,
            partition_bits,
        )


def _log2(n: int) -> int:
    return n.bit_length() - 1


def sort_stack(members: list[StackMember], geometry: LayoutGeometry) -> SortedStack:
    """Packs every entry of the stack into a key and sorts the keys."""
    g = geometry
    log_n = _log2(g.num_partitions)
    sample_bits = _bits(g.samples_per_slot - 1)
    local_bits = _bits(g.rows_per_partition - 1)
    nnz = sum(m.ids.size for m in members)
    gains = _member_gains(members)
    # The scan reads an entry's original index only to fetch its gain: with
    # unit gains the keys go without it, which leaves room for larger batches.
    index_bits = 0 if gains is None else max(_bits(nnz - 1), 1)
    key_bits = _bits(g.num_slots - 1) + _log2(g.max_minibatches) + log_n + local_bits + sample_bits
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
    # Sorting the packed keys carries each entry's original index along. The
    # keys are packed in index order, and within one slot the sample grows
    # with the index (features follow each other, rows within a feature), so
    # a stable sort by (slot, partition, local id) alone orders whole keys.
    low = index_bits + sample_bits
    slot_bits = _bits(g.num_slots - 1)
    packed = stable_sort_by_bits(packed, low, low + local_bits + log_n + slot_bits)
    return SortedStack(packed, index_bits, gains, local_bits, sample_bits)


def minibatching_split(
    stack: SortedStack, geometry: LayoutGeometry, limits: Limits
) -> tuple[bool, int]:
    """`(exceeds a limit, split mask)` of one stack (module `_minibatch`)."""
    g = geometry
    log_n = _log2(g.num_partitions)
    ids, unique = count_buckets(*stack.key_fields(log_n), g.num_slots * g.num_partitions)
    over = bool(
        (ids.sum(axis=1) > limits.max_ids_per_partition).any()
        or (unique.sum(axis=1) > limits.max_unique_ids_per_partition).any()
    )
    if not over:
        return False, 0
    mask = split_mask(
        ids, unique, limits.max_ids_per_partition, limits.max_unique_ids_per_partition
    )
    return True, int(mask)


def _member_gains(members) -> np.ndarray | None:
    if all(m.gains is None for m in members):
        return None
    return np.concatenate(
        [np.ones(m.ids.size, np.float32) if m.gains is None else m.gains for m in members]
    )


def _with_minibatches(stack: SortedStack, geometry: LayoutGeometry, minibatches: np.ndarray):
    """The stack's keys re-keyed as (slot, minibatch, partition, ...) and sorted."""
    log_n = _log2(geometry.num_partitions)
    packed = np.empty_like(stack.packed)
    add_minibatch_to_keys(*stack.key_fields(log_n), minibatches, packed)
    # The input is sorted, so within one (slot, minibatch) the rest of the
    # key is in order already: a stable sort by those two fields suffices.
    low = stack.index_bits + stack.group_shift + log_n
    return stable_sort_by_bits(packed, low, low + BUCKET_BITS + _bits(geometry.num_slots - 1))


def lay_out_sorted(
    *,
    table: str,
    stack: SortedStack,
    geometry: LayoutGeometry,
    limits: Limits,
    allow_id_dropping: bool,
    minibatches: np.ndarray | None = None,
) -> StackLayout:
    """Lays out one stacked table's sorted entries for the host's devices.

    Args:
      table: stack name, for messages.
      stack: the stack's sorted entries.
      geometry: static sizes.
      limits: the stack's per-partition limits (per minibatch when split).
      allow_id_dropping: drop over-limit entries (counted) instead of raising.
      minibatches: `int64[64]` minibatch of every bucket when the batch is
        split; requires `geometry.max_minibatches == 64`.

    Returns:
      The layout buffers and the stats (of the whole batch, counted after
      merging, before dropping).

    Raises:
      LimitBreachError: a limit or the buffer is exceeded and dropping is off.
    """
    g = geometry
    n = g.num_partitions
    log_n = _log2(n)
    mb_bits = _log2(g.max_minibatches)
    packed = stack.packed if minibatches is None else _with_minibatches(stack, g, minibatches)
    buffers, (embedding_ids, sample_ids, out_gains) = _BUFFERS.acquire(g.local_devices * g.coo_size)
    counts, unique_counts, kept, dropped = scan_sorted_entries(
        packed,
        stack.index_bits,
        _NO_GAINS if stack.gains is None else stack.gains,
        stack.gains is None,
        stack.group_shift,
        stack.sample_bits,
        stack.local_bits,
        log_n + (mb_bits if minibatches is not None else 0),
        g.num_slots * n * (g.max_minibatches if minibatches is not None else 1),
        g.slot_capacity,
        limits.max_ids_per_partition,
        limits.max_unique_ids_per_partition,
        embedding_ids,
        sample_ids,
        out_gains,
    )
    _mark_written(buffers, kept, g)
    # A later call reuses these buffers and pads again only what this one
    # wrote; read-only views keep writes by the caller from going unpadded.
    for array in (embedding_ids, sample_ids, out_gains):
        array.flags.writeable = False
    if dropped and not allow_id_dropping:
        raise LimitBreachError(
            _breach_message(table, g, limits, counts, unique_counts, kept, minibatches)
        )
    used = 1 if minibatches is None else g.max_minibatches
    return StackLayout(
        row_pointers=_row_pointers(kept.reshape(g.num_slots, used, n), g),
        embedding_ids=embedding_ids,
        sample_ids=sample_ids,
        gains=out_gains,
        **_batch_stats(counts, unique_counts, g, used),
        dropped=int(dropped),
        num_minibatches=1 if minibatches is None else int(minibatches[-1]) + 1,
    )


def _mark_written(buffers, kept: np.ndarray, geometry: LayoutGeometry) -> None:
    """Records each slot's written range: its start up to its aligned end."""
    g = geometry
    starts = np.arange(g.num_slots, dtype=np.int64) * g.slot_capacity
    ends = _round_up8(kept.reshape(g.num_slots, -1)).sum(axis=1)
    buffers.mark_written(starts, starts + ends)


def _row_pointers(kept: np.ndarray, geometry: LayoutGeometry) -> np.ndarray:
    """`int32[slots * max_minibatches * width]` from kept counts `[slots, used, N]`.

    Segments follow each other in (minibatch, partition) order within a slot,
    each starting at the previous end rounded up to 8; minibatches beyond the
    used ones are empty segments at the slot's end.
    """
    slots, used, n = kept.shape
    counts = kept.reshape(slots, -1).astype(np.int64)
    aligned = _round_up8(counts)
    ends = np.cumsum(aligned, axis=1)
    width = geometry.max_minibatches * geometry.row_pointer_width
    pointers = _aligned_full(slots * width, 0, np.int32).reshape(
        slots, geometry.max_minibatches, -1
    )
    pointers[:, :used, :n] = (ends - aligned + counts).reshape(slots, used, n)
    pointers[:, :used, n:] = ends.reshape(slots, used, n)[:, :, -1:]
    # Unused minibatches: empty segments, every pointer at the slot's end.
    pointers[:, used:] = ends[:, -1:, None]
    return pointers.reshape(-1)


def _batch_stats(counts, unique_counts, geometry: LayoutGeometry, used: int) -> dict:
    """Whole-batch stats from per-(slot, minibatch, partition) counts.

    Minibatches hold disjoint columns, so entries and distinct columns add up.
    """
    g = geometry
    shape = (g.local_devices, g.slots_per_device, used, g.num_partitions)
    per_slot = counts.reshape(shape).sum(axis=2)
    unique_per_slot = unique_counts.reshape(shape).sum(axis=2)
    return dict(
        max_ids_per_partition=per_slot.max(axis=1).reshape(-1).astype(np.int32),
        max_unique_ids_per_partition=unique_per_slot.max(axis=1).reshape(-1).astype(np.int32),
        required_buffer_size_per_sc=_round_up8(per_slot.reshape(g.num_slots, -1))
        .sum(axis=1)
        .astype(np.int32),
    )
