"""Grain's global shuffle order, computed for a whole batch of positions at once.

`grain.MapDataset.range(R).shuffle(seed)` puts record
`index_shuffle(i, R - 1, (seed + e) mod 2**32)` at position `i` of epoch `e`,
one Python call per position. `shuffled_indices` computes the same
permutation in one compiled loop over an array of positions: a 4-round Simon
cipher on `B`-bit blocks (`B = max(16, ceil(log2(R - 1)))` rounded up to
even), its round keys from `std::seed_seq{seed}`, walking the cycle until
the value is at most `R - 1`
(grain/_src/python/experimental/index_shuffle/index_shuffle.cc). A test
checks it against Grain position by position.

`epoch_positions` inverts it: the rounds undone in reverse order, walking the
cycle backwards, give the position each record takes in an epoch (what the
FDO job needs to put every record into the batches training draws).
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np

from pipelines._batching import BatchingConfig, BatchPlan, FileOrder

_ROUNDS = 4
_MIN_BLOCK_BITS = 16
_MASK32 = 0xFFFFFFFF
# The cipher's rotations; unsigned, so that the compiled shifts stay in uint64.
_ROTATE_1, _ROTATE_2, _ROTATE_8 = np.uint64(1), np.uint64(2), np.uint64(8)


def _seed_seq_generate(seed: int, count: int) -> list[int]:
    """`std::seed_seq{seed}.generate` of `count` 32-bit words (C++ [rand.util.seedseq])."""
    words = [0x8B8B8B8B] * count
    if count >= 7:
        t = 11 if count >= 623 else 7 if count >= 68 else 5 if count >= 39 else 3
    else:
        t = (count - 1) // 2
    p, q = (count - t) // 2, (count - t) // 2 + t
    m = max(2, count)  # max(s + 1, n) for s = 1 seed word
    for k in range(m):
        mixed = words[k % count] ^ words[(k + p) % count] ^ words[(k - 1) % count]
        r1 = (1664525 * _mix(mixed)) & _MASK32
        r2 = (r1 + (1 if k == 0 else 1 % count + seed if k == 1 else k % count)) & _MASK32
        words[(k + p) % count] = (words[(k + p) % count] + r1) & _MASK32
        words[(k + q) % count] = (words[(k + q) % count] + r2) & _MASK32
        words[k % count] = r2
    for k in range(m, m + count):
        summed = (words[k % count] + words[(k + p) % count] + words[(k - 1) % count]) & _MASK32
        r3 = (1566083941 * _mix(summed)) & _MASK32
        r4 = (r3 - k % count) & _MASK32
        words[(k + p) % count] ^= r3
        words[(k + q) % count] ^= r4
        words[k % count] = r4
    return words


def _mix(x: int) -> int:
    return x ^ (x >> 27)


@functools.lru_cache(maxsize=64)
def _round_keys(seed: int) -> tuple[int, ...]:
    return tuple(_seed_seq_generate(seed, _ROUNDS))


def _word_bits(max_index: int) -> int:
    bits = math.ceil(math.log2(max_index))
    return max(bits + bits % 2, _MIN_BLOCK_BITS) // 2


@numba.njit(cache=True, nogil=True)
def _cycle_walk(values, keys, w, mask, max_index):
    """Encrypts each of `values` (`uint64[k]`, in place) until it is at most `max_index`.

    `keys`: `uint64[4]` round keys, masked to `w` bits; `w`: bits of a half
    block, `mask` its `2**w - 1`; all scalars `uint64`, so that no arithmetic
    leaves unsigned ints.
    """
    for i in range(values.size):
        value = values[i]
        while True:
            left = (value >> w) & mask
            right = value & mask
            for r in range(0, keys.size, 2):
                left ^= _round_function(right, w, mask) ^ keys[r]
                right ^= _round_function(left, w, mask) ^ keys[r + 1]
            value = (left << w) | right
            if value <= max_index:
                break
        values[i] = value


@numba.njit(cache=True, nogil=True)
def _cycle_walk_back(values, keys, w, mask, max_index):
    """Decrypts each of `values` (in place) until it is at most `max_index`.

    `_cycle_walk`'s inverse: the rounds undone in reverse order.
    """
    for i in range(values.size):
        value = values[i]
        while True:
            left = (value >> w) & mask
            right = value & mask
            for r in range(keys.size - 2, -1, -2):
                right ^= _round_function(left, w, mask) ^ keys[r + 1]
                left ^= _round_function(right, w, mask) ^ keys[r]
            value = (left << w) | right
            if value <= max_index:
                break
        values[i] = value


@numba.njit(cache=True, nogil=True, inline="always")
def _round_function(x, w, mask):
    rotated_1, rotated_8 = _rotl(x, _ROTATE_1, w, mask), _rotl(x, _ROTATE_8, w, mask)
    return (rotated_1 & rotated_8) ^ _rotl(x, _ROTATE_2, w, mask)


@numba.njit(cache=True, nogil=True, inline="always")
def _rotl(x, r, w, mask):
    return ((x << r) | (x >> (w - r))) & mask


def shuffled_indices(indices: np.ndarray, max_index: int, seed: int) -> np.ndarray:
    """`int64[k]` the positions `indices` (`int[k]`, each in `[0, max_index]`) permuted.

    Equals `[index_shuffle(i, max_index=max_index, seed=seed, rounds=4) for i
    in indices]` of Grain's `index_shuffle_module`.
    """
    return _permuted(indices, max_index, seed, _cycle_walk)


def unshuffled_indices(indices: np.ndarray, max_index: int, seed: int) -> np.ndarray:
    """`int64[k]` the inverse permutation of `shuffled_indices` at `indices`."""
    return _permuted(indices, max_index, seed, _cycle_walk_back)


def _permuted(indices: np.ndarray, max_index: int, seed: int, walk) -> np.ndarray:
    values = np.array(indices, np.uint64).reshape(-1)
    if max_index == 0:
        return np.zeros(values.shape, np.int64)
    w = _word_bits(max_index)
    mask = (1 << w) - 1
    keys = np.array([key & mask for key in _round_keys(seed)], np.uint64)
    walk(values, keys, np.uint64(w), np.uint64(mask), np.uint64(max_index))
    return values.astype(np.int64)


def grain_epoch_order(num_records: int, seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
    """`int64[k]` the records at `positions` (`int[k]`) of `epoch` in Grain's shuffle.

    Equals `grain.MapDataset.range(R).shuffle(seed)[epoch * R + p]` for each
    position `p`.
    """
    return shuffled_indices(positions, num_records - 1, (seed + epoch) % 2**32)


class GrainShuffle:
    """Grain's global shuffle as an `EpochOrder`: a new permutation per epoch.

    Position `i` of epoch `e` is record `MapDataset.range(R).shuffle(seed)[e * R + i]`.
    """

    def __init__(self, num_records: int, seed: int):
        self._num_records = num_records
        self._seed = seed

    def __call__(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        return grain_epoch_order(self._num_records, self._seed, epoch, positions)

    def positions(self, epoch: int, records: np.ndarray) -> np.ndarray:
        return grain_epoch_positions(self._num_records, self._seed, epoch, records)


def batch_plan(num_records: int, batching: BatchingConfig) -> BatchPlan:
    """The plan of `batching`: file order, or Grain's shuffle of `batching.shuffle_seed`."""
    seed = batching.shuffle_seed
    order = FileOrder() if seed is None else GrainShuffle(num_records, seed)
    return BatchPlan(config=batching, num_records=num_records, order=order)


def grain_epoch_positions(
    num_records: int, seed: int, epoch: int, records: np.ndarray
) -> np.ndarray:
    """`int64[k]` the positions of `records` (`int[k]`) in `epoch`: `grain_epoch_order` inverted."""
    return unshuffled_indices(records, num_records - 1, (seed + epoch) % 2**32)
