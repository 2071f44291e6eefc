"""Minibatching: splitting a batch whose partitions exceed the limits (docs/design.md section 3).

Every column (row of a stacked table) is hashed into one of 64 buckets. A
63-bit split mask over the binary tree of the buckets says where the bucket
range is cut into minibatches:

* bits 0-31 are the nodes of 2 buckets, 32-47 of 4, 48-55 of 8, 56-59 of 16,
  60-61 of 32 and bit 62 the root; node j of size m starts at bucket j * m;
* a set bit at a node starting at bucket i of size m cuts at i + m/2;
* per (slot, partition) of every table, bottom-up, a node is cut when its two
  halves together exceed `max_ids_per_partition` or
  `max_unique_ids_per_partition` (bucket counts are additive: a column lies in
  one bucket only);
* the masks are ORed over partitions, slots, devices and tables, then over
  hosts. Minibatch k holds the buckets between the k-th and (k+1)-th cut.

Each row of a table belongs to exactly one minibatch, so looking up and
updating minibatch by minibatch equals a single pass for any row-wise
optimizer.

The bucket of column c is `splitmix64(c) & 63`, with splitmix64 the finalizer
of Steele, Lea and Flood (2014):

    z = c + 0x9E3779B97F4A7C15                  (mod 2**64)
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9    (mod 2**64)
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB    (mod 2**64)
    z = z ^ (z >> 31)
"""

from __future__ import annotations

from typing import Protocol

import numba
import numpy as np

NUM_BUCKETS = 64
BUCKET_BITS = 6
SPLIT_BITS = 63


class AllReduceInterface(Protocol):
    """Cross-host OR agreement, as the preprocessing calls it (docs/design.md section 4).

    Every host (and each of its K local contributors) calls a method with the
    same key for the same round; every call returns the OR over all of them.
    The preprocessing uses key `2 * batch` for the minibatching flag and
    `2 * batch + 1` for the split mask. `parallel.allreduce` implements it
    across hosts (`AllReduceNode.interface()`, `LazyAllReduce`).
    """

    def all_reduce_bool(self, sync_key: int, value: bool) -> bool: ...

    def all_reduce_uint64(self, sync_key: int, value: int) -> int: ...


@numba.njit(cache=True, nogil=True)
def bucket_of(column):
    """The bucket (0..63) of a column id (int64)."""
    z = np.uint64(column) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return np.int64(z & np.uint64(NUM_BUCKETS - 1))


@numba.njit(cache=True, nogil=True)
def count_buckets(
    packed, index_bits, group_shift, sample_bits, local_bits, partition_bits, num_groups
):
    """Merged entries and distinct columns per (group, bucket) of sorted keys.

    Args:
      packed: `int64[nnz]` sorted packed keys (see `_layout_kernel`).
      num_groups: slots * N.

    Returns:
      `(ids, unique)`, each `int64[num_groups, 64]`.
    """
    ids = np.zeros((num_groups, NUM_BUCKETS), np.int64)
    unique = np.zeros((num_groups, NUM_BUCKETS), np.int64)
    local_mask = (np.int64(1) << local_bits) - 1
    partition_mask = (np.int64(1) << partition_bits) - 1
    prev_key = np.int64(-1)
    prev_col = np.int64(-1)
    for i in range(packed.size):
        key = packed[i] >> index_bits
        if key == prev_key:
            continue
        prev_key = key
        group = key >> group_shift
        col_key = key >> sample_bits
        column = ((col_key & local_mask) << partition_bits) | (group & partition_mask)
        bucket = bucket_of(column)
        ids[group, bucket] += 1
        if col_key != prev_col:
            prev_col = col_key
            unique[group, bucket] += 1
    return ids, unique


@numba.njit(cache=True, nogil=True)
def split_mask(ids, unique, max_ids, max_unique):
    """The OR over groups of each group's bottom-up split (module docstring).

    Args:
      ids: `int64[groups, 64]` entries per bucket.
      unique: `int64[groups, 64]` distinct columns per bucket.

    Returns:
      The 63-bit mask as int64.
    """
    mask = np.int64(0)
    for g in range(ids.shape[0]):
        level_ids = ids[g].copy()
        level_unique = unique[g].copy()
        width = NUM_BUCKETS
        bit = 0
        while width > 1:
            width //= 2
            for j in range(width):
                merged_ids = level_ids[2 * j] + level_ids[2 * j + 1]
                merged_unique = level_unique[2 * j] + level_unique[2 * j + 1]
                if merged_ids > max_ids or merged_unique > max_unique:
                    mask |= np.int64(1) << (bit + j)
                level_ids[j] = merged_ids
                level_unique[j] = merged_unique
            bit += width
    return mask


def minibatch_of_bucket(mask: int) -> np.ndarray:
    """`int64[64]` minibatch of every bucket under a split mask.

    Raises:
      ValueError: the mask has bits outside the 63 split bits.
    """
    if not 0 <= mask < 1 << SPLIT_BITS:
        raise ValueError(f"A minibatching split mask has 63 bits; got {mask:#x}.")
    cuts = np.zeros(NUM_BUCKETS, np.int64)
    bit, width, size = 0, NUM_BUCKETS // 2, 2
    while width:
        for j in range(width):
            if mask >> (bit + j) & 1:
                cuts[j * size + size // 2] = 1
        bit, width, size = bit + width, width // 2, size * 2
    return np.cumsum(cuts)


@numba.njit(cache=True, nogil=True)
def add_minibatch_to_keys(
    packed, index_bits, group_shift, sample_bits, local_bits, partition_bits, minibatch, out
):
    """Re-keys sorted entries as (slot, minibatch, partition, local, sample).

    Args:
      packed: `int64[nnz]` packed keys without the minibatch field.
      minibatch: `int64[64]` minibatch of every bucket.
      out: `int64[nnz]` receives the new packed keys (unsorted).
    """
    index_mask = (np.int64(1) << index_bits) - 1
    low_mask = (np.int64(1) << group_shift) - 1
    local_mask = (np.int64(1) << local_bits) - 1
    partition_mask = (np.int64(1) << partition_bits) - 1
    for i in range(packed.size):
        key = packed[i] >> index_bits
        group = key >> group_shift
        partition = group & partition_mask
        column = (((key >> sample_bits) & local_mask) << partition_bits) | partition
        slot = group >> partition_bits
        new_group = (
            ((slot << BUCKET_BITS) | minibatch[bucket_of(column)]) << partition_bits
        ) | partition
        out[i] = (((new_group << group_shift) | (key & low_mask)) << index_bits) | (
            packed[i] & index_mask
        )
