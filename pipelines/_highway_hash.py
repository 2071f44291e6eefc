"""HighwayHash-64, the checksum of Riegeli (and so ArrayRecord) files, compiled.

Riegeli checks every block header, chunk header and chunk's data with
HighwayHash-64 under a fixed key. This is the algorithm's portable form (the
reference implementation's scalar code path), over 64-bit little-endian lanes.
"""

from __future__ import annotations

import numba
import numpy as np

# The key Riegeli hashes with: the bytes "Riegeli/records\n" twice.
RIEGELI_KEY = np.array(
    [0x2F696C6567656952, 0x0A7364726F636572, 0x2F696C6567656952, 0x0A7364726F636572],
    np.uint64,
)
_INIT0 = np.array(
    [0xDBE6D5D5FE4CCE2F, 0xA4093822299F31D0, 0x13198A2E03707344, 0x243F6A8885A308D3], np.uint64
)
_INIT1 = np.array(
    [0x3BD39E10CB0EF593, 0xC0ACF169B5F18A8C, 0xBE5466CF34E90C6C, 0x452821E638D01377], np.uint64
)
_LOW32 = np.uint64(0xFFFFFFFF)


@numba.njit(inline="always")
def _zipper_merge(v1, v0):
    """The byte shuffle of two lanes; returns `(add_to_lane_1, add_to_lane_0)`."""
    a0 = (
        (((v0 & np.uint64(0xFF000000)) | (v1 & np.uint64(0xFF00000000))) >> np.uint64(24))
        | (((v0 & np.uint64(0xFF0000000000)) | (v1 & np.uint64(0xFF000000000000))) >> np.uint64(16))
        | (v0 & np.uint64(0xFF0000))
        | ((v0 & np.uint64(0xFF00)) << np.uint64(32))
        | ((v1 & np.uint64(0xFF00000000000000)) >> np.uint64(8))
        | (v0 << np.uint64(56))
    )
    a1 = (
        (((v1 & np.uint64(0xFF000000)) | (v0 & np.uint64(0xFF00000000))) >> np.uint64(24))
        | (v1 & np.uint64(0xFF0000))
        | ((v1 & np.uint64(0xFF0000000000)) >> np.uint64(16))
        | ((v1 & np.uint64(0xFF00)) << np.uint64(24))
        | ((v0 & np.uint64(0xFF000000000000)) >> np.uint64(8))
        | ((v1 & np.uint64(0xFF)) << np.uint64(48))
        | (v0 & np.uint64(0xFF00000000000000))
    )
    return a1, a0


@numba.njit(inline="always")
def _mix(v0, v1, mul0, mul1, lane):
    """One lane of a round: `(v0, v1, mul0, mul1)` after taking in `lane`."""
    v1 += mul0 + lane
    mul0 ^= (v1 & _LOW32) * (v0 >> np.uint64(32))
    v0 += mul1
    mul1 ^= (v0 & _LOW32) * (v1 >> np.uint64(32))
    return v0, v1, mul0, mul1


@numba.njit(inline="always")
def _update(state, a, b, c, d):
    """One round over a 32-byte packet of lanes `a` to `d`.

    `state` is `(v0, v1, mul0, mul1)`, each a 4-tuple of uint64 lanes: tuples
    are values, where arrays would be allocated on every hash.
    """
    v0, v1, mul0, mul1 = state
    l0 = _mix(v0[0], v1[0], mul0[0], mul1[0], a)
    l1 = _mix(v0[1], v1[1], mul0[1], mul1[1], b)
    l2 = _mix(v0[2], v1[2], mul0[2], mul1[2], c)
    l3 = _mix(v0[3], v1[3], mul0[3], mul1[3], d)
    a1, a0 = _zipper_merge(l1[1], l0[1])
    b1, b0 = _zipper_merge(l3[1], l2[1])
    v0 = (l0[0] + a0, l1[0] + a1, l2[0] + b0, l3[0] + b1)
    a1, a0 = _zipper_merge(v0[1], v0[0])
    b1, b0 = _zipper_merge(v0[3], v0[2])
    v1 = (l0[1] + a0, l1[1] + a1, l2[1] + b0, l3[1] + b1)
    return v0, v1, (l0[2], l1[2], l2[2], l3[2]), (l0[3], l1[3], l2[3], l3[3])


@numba.njit(inline="always")
def _rotate32_by(value, count):
    """Rotates each 32-bit half of `value` left by `count` (0 to 31) bits."""
    if count == 0:
        return value
    c = np.uint64(count)
    back = np.uint64(32 - count)
    low = value & _LOW32
    high = value >> np.uint64(32)
    low = ((low << c) | (low >> back)) & _LOW32
    high = ((high << c) | (high >> back)) & _LOW32
    return (high << np.uint64(32)) | low


@numba.njit(inline="always")
def _packet_byte(data, tail, remainder, i):
    """Byte `i` of the last packet the algorithm forms of a `remainder` (1 to 31)
    byte tail at `data[tail:]`: the whole 4-byte groups first, then the last
    four bytes at 28 (a tail of 16 or more) or three picked bytes at 16."""
    whole4 = remainder & ~3
    mod4 = remainder & 3
    if i < whole4:
        return data[tail + i]
    if remainder & 16:
        if i >= 28:
            return data[tail + whole4 + i - 28 + mod4 - 4]
    elif mod4:
        if i == 16:
            return data[tail + whole4]
        if i == 17:
            return data[tail + whole4 + (mod4 >> 1)]
        if i == 18:
            return data[tail + whole4 + mod4 - 1]
    return 0


@numba.njit(inline="always")
def _packet_lane(data, tail, remainder, lane):
    value = np.uint64(0)
    for k in range(8):
        value |= np.uint64(_packet_byte(data, tail, remainder, 8 * lane + k)) << np.uint64(8 * k)
    return value


@numba.njit(inline="always")
def _swap_halves(x):
    return (x >> np.uint64(32)) | (x << np.uint64(32))


@numba.njit(cache=True, nogil=True)
def highway_hash64(data, start, size, key):
    """HighwayHash-64 of `data[start:start + size]` (`uint8[n]`) under `key` (`uint64[4]`)."""
    mul0 = (_INIT0[0], _INIT0[1], _INIT0[2], _INIT0[3])
    mul1 = (_INIT1[0], _INIT1[1], _INIT1[2], _INIT1[3])
    v0 = (mul0[0] ^ key[0], mul0[1] ^ key[1], mul0[2] ^ key[2], mul0[3] ^ key[3])
    v1 = (
        mul1[0] ^ _swap_halves(key[0]),
        mul1[1] ^ _swap_halves(key[1]),
        mul1[2] ^ _swap_halves(key[2]),
        mul1[3] ^ _swap_halves(key[3]),
    )
    state = (v0, v1, mul0, mul1)
    whole = size & ~31
    # Lanes are little-endian, as the view reads them on the x86 and Arm
    # hosts this runs on.
    words = data[start : start + whole].view(np.uint64)
    for w in range(0, whole // 8, 4):
        state = _update(state, words[w], words[w + 1], words[w + 2], words[w + 3])
    remainder = size & 31
    if remainder:
        v0, v1, mul0, mul1 = state
        grow = np.uint64((remainder << 32) + remainder)
        v0 = (v0[0] + grow, v0[1] + grow, v0[2] + grow, v0[3] + grow)
        v1 = (
            _rotate32_by(v1[0], remainder),
            _rotate32_by(v1[1], remainder),
            _rotate32_by(v1[2], remainder),
            _rotate32_by(v1[3], remainder),
        )
        state = (v0, v1, mul0, mul1)
        tail = start + whole
        state = _update(
            state,
            _packet_lane(data, tail, remainder, 0),
            _packet_lane(data, tail, remainder, 1),
            _packet_lane(data, tail, remainder, 2),
            _packet_lane(data, tail, remainder, 3),
        )
    for _ in range(4):
        v0 = state[0]
        state = _update(
            state,
            _swap_halves(v0[2]),
            _swap_halves(v0[3]),
            _swap_halves(v0[0]),
            _swap_halves(v0[1]),
        )
    v0, v1, mul0, mul1 = state
    return v0[0] + v1[0] + mul0[0] + mul1[0]
