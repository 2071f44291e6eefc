"""Grain's global shuffle order, computed for a whole batch of positions at once.

`grain.MapDataset.range(R).shuffle(seed)` puts record
`index_shuffle(i, R - 1, (seed + e) mod 2**32)` at position `i` of epoch `e`,
one Python call per position. `shuffled_indices` computes the same
permutation with numpy over an array of positions: a 4-round Simon cipher on
`B`-bit blocks (`B = max(16, ceil(log2(R - 1)))` rounded up to even), its
round keys from `std::seed_seq{seed}`, walking the cycle until the value is
at most `R - 1` (grain/_src/python/experimental/index_shuffle/index_shuffle.cc).
A test checks it against Grain position by position.
"""

from __future__ import annotations

import functools
import math

import grain
import numpy as np

_ROUNDS = 4
# Mean cipher rounds per position up to which the batch is walked with numpy.
_MAX_MEAN_WALK = 4
_MIN_BLOCK_BITS = 16
_MASK32 = 0xFFFFFFFF


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


def _rotl(x: np.ndarray, r: int, w: int, mask: np.uint64) -> np.ndarray:
    return ((x << np.uint64(r)) | (x >> np.uint64(w - r))) & mask


def _simon_encrypt(values: np.ndarray, keys: tuple[int, ...], w: int) -> np.ndarray:
    mask = np.uint64((1 << w) - 1)
    left = (values >> np.uint64(w)) & mask
    right = values & mask

    def f(x: np.ndarray) -> np.ndarray:
        return (_rotl(x, 1, w, mask) & _rotl(x, 8, w, mask)) ^ _rotl(x, 2, w, mask)

    for k1, k2 in zip(keys[::2], keys[1::2], strict=True):
        left ^= f(right) ^ np.uint64(k1 & int(mask))
        right ^= f(left) ^ np.uint64(k2 & int(mask))
    return (left << np.uint64(w)) | right


def shuffled_indices(indices: np.ndarray, max_index: int, seed: int) -> np.ndarray:
    """`int64[k]` the positions `indices` (`int[k]`, each in `[0, max_index]`) permuted.

    Equals `[index_shuffle(i, max_index=max_index, seed=seed, rounds=4) for i
    in indices]` of Grain's `index_shuffle_module`.
    """
    values = np.asarray(indices, np.uint64)
    if max_index == 0:
        return np.zeros(values.shape, np.int64)
    keys, w = _round_keys(seed), _word_bits(max_index)
    values = _simon_encrypt(values, keys, w)
    outside = np.flatnonzero(values > np.uint64(max_index))
    while outside.size:
        walked = _simon_encrypt(values[outside], keys, w)
        values[outside] = walked
        outside = outside[walked > np.uint64(max_index)]
    return values.astype(np.int64)


def grain_epoch_order(num_records: int, seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
    """`int64[k]` the records at `positions` (`int[k]`) of `epoch` in Grain's shuffle.

    Equals `grain.MapDataset.range(R).shuffle(seed)[epoch * R + p]` for each
    position `p`. A dataset much smaller than the cipher's smallest block
    (`2**16`) makes the cycle walk long, which Grain's compiled loop does
    faster one position at a time than numpy does for the batch.
    """
    if num_records * _MAX_MEAN_WALK < 2 ** (2 * _word_bits(max(num_records - 1, 1))):
        order = _grain_order(num_records, seed)
        offset = epoch * num_records
        return np.fromiter(
            (order[offset + int(p)] for p in positions), np.int64, count=len(positions)
        )
    return shuffled_indices(positions, num_records - 1, (seed + epoch) % 2**32)


@functools.lru_cache(maxsize=8)
def _grain_order(num_records: int, seed: int) -> grain.MapDataset:
    return grain.MapDataset.range(num_records).shuffle(seed=seed)
