"""HighwayHash-64, the checksum of Riegeli (and so ArrayRecord) files, compiled.

Riegeli checks every block header, chunk header and chunk's data with
HighwayHash-64 under a fixed key. The state is four vectors of four 64-bit
lanes, updated as the reference implementation's AVX2 code path does: the
rounds are written as LLVM vector operations (`_vector_*` intrinsics), which
LLVM turns into the CPU's SIMD instructions where it has them (a byte
shuffle for the zipper merge, 32x32-bit multiplies; the speed against the
scalar form is in docs/benchmarks.md) and into scalar code where it has not,
with the same results. Between calls the state travels as a 16-tuple of
uint64 (`v0`, `v1`, `mul0`, `mul1`, four lanes each), a value, where arrays
would be allocated on every hash.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

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

_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_LANES = ir.VectorType(_I64, 4)
_BYTES = ir.VectorType(_I8, 32)
_HALVES = ir.VectorType(_I32, 8)
# Each output byte of the zipper merge by its source byte, within each
# 128-bit half (the reference's shuffle mask).
_ZIPPER = [3, 12, 2, 5, 14, 1, 15, 0, 11, 4, 10, 13, 9, 6, 8, 7]
_ZIPPER_MASK = ir.Constant(
    ir.VectorType(_I32, 32), [ir.Constant(_I32, b + h) for h in (0, 16) for b in _ZIPPER]
)
# The finalization's packet: lanes 2, 3, 0, 1 of v0, each with its 32-bit halves swapped.
_PERMUTE_MASK = ir.Constant(
    ir.VectorType(_I32, 8), [ir.Constant(_I32, i) for i in (5, 4, 7, 6, 1, 0, 3, 2)]
)


def _splat(value: int) -> ir.Constant:
    return ir.Constant(_LANES, [ir.Constant(_I64, value)] * 4)


def _unpack(builder, state):
    """The 16-tuple as the vectors `[v0, v1, mul0, mul1]`."""
    vectors = []
    for k in range(4):
        vector = ir.Constant(_LANES, ir.Undefined)
        for lane in range(4):
            value = builder.extract_value(state, 4 * k + lane)
            vector = builder.insert_element(vector, value, ir.Constant(_I32, lane))
        vectors.append(vector)
    return vectors


def _pack(builder, vectors, state_type):
    state = ir.Constant(state_type, ir.Undefined)
    for k, vector in enumerate(vectors):
        for lane in range(4):
            value = builder.extract_element(vector, ir.Constant(_I32, lane))
            state = builder.insert_value(state, value, 4 * k + lane)
    return state


def _zipper_merge(builder, vector):
    as_bytes = builder.bitcast(vector, _BYTES)
    shuffled = builder.shuffle_vector(as_bytes, ir.Constant(_BYTES, ir.Undefined), _ZIPPER_MASK)
    return builder.bitcast(shuffled, _LANES)


def _round(builder, vectors, packet):
    """One round of the state `[v0, v1, mul0, mul1]` over a packet of four lanes."""
    v0, v1, mul0, mul1 = vectors
    low32, high = _splat(0xFFFFFFFF), _splat(32)
    v1 = builder.add(v1, builder.add(mul0, packet))
    mul0 = builder.xor(mul0, builder.mul(builder.and_(v1, low32), builder.lshr(v0, high)))
    v0 = builder.add(v0, mul1)
    mul1 = builder.xor(mul1, builder.mul(builder.and_(v0, low32), builder.lshr(v1, high)))
    v0 = builder.add(v0, _zipper_merge(builder, v1))
    v1 = builder.add(v1, _zipper_merge(builder, v0))
    return [v0, v1, mul0, mul1]


@intrinsic
def _vector_packets(typingctx, state, data, start, count):
    """The state after `count` rounds over the 32-byte packets from `data[start]`
    (`uint8[n]`, C order; the lanes little-endian)."""
    if not (isinstance(data, types.Array) and data.ndim == 1 and data.layout == "C"):
        return None

    def codegen(context, builder, signature, args):
        state_value, array_value, start_value, count_value = args
        array = context.make_array(signature.args[1])(context, builder, array_value)
        first = builder.gep(array.data, [start_value])
        slots = [cgutils.alloca_once_value(builder, v) for v in _unpack(builder, state_value)]
        with cgutils.for_range(builder, count_value) as loop:
            offset = builder.mul(loop.index, ir.Constant(loop.index.type, 32))
            address = builder.bitcast(builder.gep(first, [offset]), _LANES.as_pointer())
            packet = builder.load(address, align=1, typ=_LANES)
            vectors = [builder.load(slot) for slot in slots]
            for slot, vector in zip(slots, _round(builder, vectors, packet), strict=True):
                builder.store(vector, slot)
        vectors = [builder.load(slot) for slot in slots]
        return _pack(builder, vectors, context.get_value_type(signature.return_type))

    return state(state, data, start, count), codegen


@intrinsic
def _vector_update(typingctx, state, a, b, c, d):
    """The state after one round over the packet of lanes `a` to `d` (uint64)."""

    def codegen(context, builder, signature, args):
        packet = ir.Constant(_LANES, ir.Undefined)
        for lane, value in enumerate(args[1:]):
            packet = builder.insert_element(packet, value, ir.Constant(_I32, lane))
        vectors = _round(builder, _unpack(builder, args[0]), packet)
        return _pack(builder, vectors, context.get_value_type(signature.return_type))

    return state(state, a, b, c, d), codegen


@intrinsic
def _vector_permute_update(typingctx, state):
    """The state after one round of the finalization (its packet taken from v0)."""

    def codegen(context, builder, signature, args):
        vectors = _unpack(builder, args[0])
        halves = builder.bitcast(vectors[0], _HALVES)
        permuted = builder.shuffle_vector(halves, ir.Constant(_HALVES, ir.Undefined), _PERMUTE_MASK)
        vectors = _round(builder, vectors, builder.bitcast(permuted, _LANES))
        return _pack(builder, vectors, context.get_value_type(signature.return_type))

    return state(state), codegen


@numba.njit(inline="always")
def _rotate32_by(value, count):
    """Rotates each 32-bit half of `value` left by `count` (1 to 31) bits."""
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
    """HighwayHash-64 of `data[start:start + size]` under `key` (`uint64[4]`).

    `data` is `uint8[n]` in C order (typing refuses any other layout: the
    packets are loaded from its memory directly).
    """
    m0, m1 = _INIT0, _INIT1
    s = (
        m0[0] ^ key[0], m0[1] ^ key[1], m0[2] ^ key[2], m0[3] ^ key[3],
        m1[0] ^ _swap_halves(key[0]), m1[1] ^ _swap_halves(key[1]),
        m1[2] ^ _swap_halves(key[2]), m1[3] ^ _swap_halves(key[3]),
        m0[0], m0[1], m0[2], m0[3],
        m1[0], m1[1], m1[2], m1[3],
    )  # fmt: skip
    s = _vector_packets(s, data, start, size // 32)
    remainder = size & 31
    if remainder:
        grow = np.uint64((remainder << 32) + remainder)
        s = (
            s[0] + grow, s[1] + grow, s[2] + grow, s[3] + grow,
            _rotate32_by(s[4], remainder), _rotate32_by(s[5], remainder),
            _rotate32_by(s[6], remainder), _rotate32_by(s[7], remainder),
            s[8], s[9], s[10], s[11], s[12], s[13], s[14], s[15],
        )  # fmt: skip
        tail = start + (size & ~31)
        s = _vector_update(
            s,
            _packet_lane(data, tail, remainder, 0),
            _packet_lane(data, tail, remainder, 1),
            _packet_lane(data, tail, remainder, 2),
            _packet_lane(data, tail, remainder, 3),
        )
    for _ in range(4):
        s = _vector_permute_update(s)
    return s[0] + s[4] + s[8] + s[12]
