"""The compiled loops of the layout: packing keys, sorting them, and one pass
over the sorted keys.

The stats and row pointers after them are numpy over small per-(slot,
partition) counts. Doing merging, limits and the buffer scatter in numpy
takes a dozen passes over the entries; here it is one, which is what lets the
host keep up with the devices (docs/design.md section 10).
"""

from __future__ import annotations

import numba
import numpy as np

# Widest digit of the radix sort: 2**13 counters per pass stay in the L1/L2
# cache while the scatter writes to as many places.
_MAX_DIGIT_BITS = 13


@numba.njit(cache=True, nogil=True)
def scan_sorted_entries(
    packed,
    index_bits,
    gains_in,
    unit_gains,
    group_shift,
    sample_bits,
    local_bits,
    slot_shift,
    num_groups,
    slot_capacity,
    max_ids,
    max_unique,
    embedding_ids,
    sample_ids,
    gains_out,
):
    """Merges, limits and scatters sorted entries into the slot buffers.

    Args:
      packed: `int64[nnz]` sorted `key << index_bits | original index`, with
        `key = ((slot, partition) << group_shift) | local << sample_bits | sample`.
      index_bits: bits of the original index in `packed`.
      gains_in: `float32[nnz]` gains in original order (unused if unit_gains).
      unit_gains: every gain is 1.
      group_shift: bits below the (slot, partition) group in a key.
      sample_bits: bits of the sample in a key.
      local_bits: bits of the local id in a key.
      slot_shift: bits below the slot in a group (log2 N, plus the minibatch
        bits when the group is (slot, minibatch, partition)).
      num_groups: slots * N (* 64 with minibatches).
      slot_capacity: buffer entries per slot (a multiple of 8).
      max_ids: max entries kept per group.
      max_unique: max distinct local ids kept per group.
      embedding_ids: `int32[slots * slot_capacity]` output, pre-filled padding;
        only each slot's start up to its aligned end is written.
      sample_ids: `int32[slots * slot_capacity]` output, likewise.
      gains_out: `float32[slots * slot_capacity]` output, likewise.

    Returns:
      `(counts, unique, kept, dropped)`: `int64[num_groups]` merged entries,
      distinct local ids, and entries written, per group; and the input
      entries not written, every occurrence merged into a dropped entry
      counted (jax-tpu-embedding's drop count).
    """
    counts = np.zeros(num_groups, np.int64)
    unique = np.zeros(num_groups, np.int64)
    kept = np.zeros(num_groups, np.int64)
    index_mask = (np.int64(1) << index_bits) - 1
    sample_mask = (np.int64(1) << sample_bits) - 1
    local_mask = (np.int64(1) << local_bits) - 1
    prev_key = np.int64(-1)
    prev_col = np.int64(-1)
    group = np.int64(-1)
    slot = np.int64(-1)
    slot_offset = np.int64(0)
    rank = np.int64(-1)
    last_out = np.int64(-1)
    dropped = np.int64(0)
    for i in range(packed.size):
        value = packed[i]
        key = value >> index_bits
        gain = np.float32(1.0) if unit_gains else gains_in[value & index_mask]
        if key == prev_key:
            if last_out >= 0:
                gains_out[last_out] += gain
            else:
                dropped += 1
            continue
        prev_key = key
        next_group = key >> group_shift
        if next_group != group:
            next_slot = next_group >> slot_shift
            if next_slot != slot:
                slot = next_slot
                slot_offset = 0
            elif group >= 0:
                slot_offset += (kept[group] + 7) // 8 * 8
            group = next_group
            rank = -1
            prev_col = -1
        col = key >> sample_bits
        if col != prev_col:
            prev_col = col
            rank += 1
            unique[group] += 1
        position = counts[group]
        counts[group] += 1
        if position < max_ids and rank < max_unique and slot_offset + position < slot_capacity:
            last_out = slot * slot_capacity + slot_offset + position
            embedding_ids[last_out] = col & local_mask
            sample_ids[last_out] = key & sample_mask
            gains_out[last_out] = gain
            kept[group] += 1
        else:
            last_out = -1
            dropped += 1
    return counts, unique, kept, dropped


@numba.njit(cache=True, nogil=True)
def pack_feature_keys(
    ids,
    row_splits,
    samples_per_slot,
    sample_offset,
    col_shift,
    col_offset,
    partition_bits,
    local_bits,
    sample_bits,
    index_bits,
    index_base,
    out,
):
    """Writes one feature's packed sort keys into `out`.

    Row r goes to slot `r // samples_per_slot` as sample `r % samples_per_slot
    + sample_offset`; id i becomes column `((i + col_shift) & (N-1)) +
    (i & ~(N-1)) + col_offset` (docs/design.md section 2, step 2), whose partition
    is `col & (N-1)` and local id `col >> log2(N)`.

    Args:
      ids: `int[nnz]` ids of the feature (checked to be in range).
      row_splits: `int64[rows + 1]`.
      out: `int64[nnz]` slice of the stack's key array receiving
        `key << index_bits | (index_base + j)` for entry j (the key alone
        when `index_bits` is 0).
    """
    partition_mask = (np.int64(1) << partition_bits) - 1
    index_mask = (np.int64(1) << index_bits) - 1
    for r in range(row_splits.size - 1):
        slot = r // samples_per_slot
        sample = r - slot * samples_per_slot + sample_offset
        prefix = np.int64(slot) << partition_bits
        for j in range(row_splits[r], row_splits[r + 1]):
            i = np.int64(ids[j])
            col = ((i + col_shift) & partition_mask) + (i & ~partition_mask) + col_offset
            key = (
                ((prefix | (col & partition_mask)) << local_bits | (col >> partition_bits))
                << sample_bits
            ) | sample
            out[j] = (key << index_bits) | ((index_base + j) & index_mask)


@numba.njit(cache=True, nogil=True)
def stable_sort_by_bits(keys, low, high):
    """Keys stably sorted by their bits `[low, high)`, bits from `high` up all zero.

    A least-significant-digit radix sort: one read counts every digit, then
    one scatter per digit of at most 13 bits (a digit all keys share is
    skipped). The layout sorts only the fields that are not already in order
    (`_layout.sort_stack`): in `benchmarks/preprocess.py`'s geometry 25 of
    the 54 bits of a packed key, two scatters. It took a tenth of `np.sort`'s
    time on the whole keys, and less than 9-bit digits or an MSD count by
    (slot, partition) followed by an LSD sort per group (docs/benchmarks.md).

    Args:
      keys: `int64[n]` non-negative; used as scratch space.
      low: lowest bit of the sort field.
      high: bit above the sort field (`keys < 2**high`).

    Returns:
      `int64[n]`, `keys` itself or a new array.
    """
    n = keys.size
    bits = high - low
    if n < 2 or bits <= 0:
        return keys
    passes = (bits + _MAX_DIGIT_BITS - 1) // _MAX_DIGIT_BITS
    digit_bits = (bits + passes - 1) // passes
    mask = (np.int64(1) << digit_bits) - 1
    counts = np.zeros((passes, 1 << digit_bits), np.int64)
    for i in range(n):
        value = keys[i] >> low
        for p in range(passes):
            counts[p, (value >> (p * digit_bits)) & mask] += 1
    source = keys
    target = np.empty_like(keys)
    for p in range(passes):
        shift = low + p * digit_bits
        offsets = counts[p]
        if offsets[(source[0] >> shift) & mask] == n:
            continue
        total = np.int64(0)
        for d in range(offsets.size):
            count = offsets[d]
            offsets[d] = total
            total += count
        for i in range(n):
            value = source[i]
            d = (value >> shift) & mask
            target[offsets[d]] = value
            offsets[d] += 1
        source, target = target, source
    return source
