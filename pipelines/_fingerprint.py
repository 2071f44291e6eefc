"""FarmHash Fingerprint64, compiled, over bytes inside a larger buffer.

`tf.strings.to_hash_bucket_fast(s, n)` maps a string to
`Fingerprint64(s) % n`, where TensorFlow's `Fingerprint64` is FarmHash's
`farmhashna::Hash64`; a string id hashed here equals the id a TensorFlow
feature column gives. The algorithm is written out (from FarmHash's
farmhash.cc, MIT licence) instead of taken from a Python binding because the
record parser hashes each string where it lies in the records' wire bytes,
inside one compiled pass: a binding would need a Python `bytes` object and a
Python call per id, which costs more than the whole parse. The tests compare
it with `tf.strings.to_hash_bucket_fast` on strings of every length class
(empty, 1-3, 4-7, 8-16, 17-32, 33-64 and longer, multiples of 64).
"""

from __future__ import annotations

import numba
import numpy as np

_K0 = np.uint64(0xC3A5C85C97CB3127)
_K1 = np.uint64(0xB492B66FBE98F273)
_K2 = np.uint64(0x9AE16A3B2F90404F)


@numba.njit(cache=True, nogil=True, inline="always")
def _byte(data, p):
    """`data[p]` as a uint64.

    An unsigned index spares numba's wraparound of negative indices, a
    branch per byte that also keeps LLVM from merging `_fetch`'s byte loads
    into one load: hashing a short string then costs several times more.
    """
    return np.uint64(data[np.uint64(p)])


@numba.njit(cache=True, nogil=True, inline="always")
def _fetch(data, p, size):
    """The little-endian unsigned integer of `data[p : p + size]` (size 4 or 8)."""
    value = np.uint64(0)
    for i in range(size):
        value |= _byte(data, p + i) << np.uint64(8 * i)
    return value


@numba.njit(cache=True, nogil=True, inline="always")
def _fetch64(data, p):
    return _fetch(data, p, 8)


@numba.njit(cache=True, nogil=True, inline="always")
def _fetch32(data, p):
    return _fetch(data, p, 4)


@numba.njit(cache=True, nogil=True, inline="always")
def _rotate(value, shift):
    return (value >> np.uint64(shift)) | (value << np.uint64(64 - shift))


@numba.njit(cache=True, nogil=True, inline="always")
def _shift_mix(value):
    return value ^ (value >> np.uint64(47))


@numba.njit(cache=True, nogil=True, inline="always")
def _hash_len16(u, v, mul):
    a = (u ^ v) * mul
    a ^= a >> np.uint64(47)
    b = (v ^ a) * mul
    b ^= b >> np.uint64(47)
    return b * mul


@numba.njit(cache=True, nogil=True, inline="always")
def _hash_len0to16(data, s, length):
    n = np.uint64(length)
    if length >= 8:
        mul = _K2 + n * np.uint64(2)
        a = _fetch64(data, s) + _K2
        b = _fetch64(data, s + length - 8)
        c = _rotate(b, 37) * mul + a
        d = (_rotate(a, 25) + b) * mul
        return _hash_len16(c, d, mul)
    if length >= 4:
        mul = _K2 + n * np.uint64(2)
        a = _fetch32(data, s)
        return _hash_len16(n + (a << np.uint64(3)), _fetch32(data, s + length - 4), mul)
    if length > 0:
        a = _byte(data, s)
        b = _byte(data, s + (length >> 1))
        c = _byte(data, s + length - 1)
        y = (a + (b << np.uint64(8))) & np.uint64(0xFFFFFFFF)
        z = (n + (c << np.uint64(2))) & np.uint64(0xFFFFFFFF)
        return _shift_mix(y * _K2 ^ z * _K0) * _K2
    return _K2


@numba.njit(cache=True, nogil=True, inline="always")
def _hash_ends16(data, s, length, mul, a_multiplier):
    """`(a, y, hash)`: FarmHash's mix of the first and the last 16 bytes, with
    which HashLen17to32 (`a_multiplier` k1) ends and HashLen33to64 (k2) begins.
    `a` and `y` are the intermediates HashLen33to64 goes on with."""
    a = _fetch64(data, s) * a_multiplier
    b = _fetch64(data, s + 8)
    c = _fetch64(data, s + length - 8) * mul
    d = _fetch64(data, s + length - 16) * _K2
    y = _rotate(a + b, 43) + _rotate(c, 30) + d
    return a, y, _hash_len16(y, a + _rotate(b + _K2, 18) + c, mul)


@numba.njit(cache=True, nogil=True)
def _hash_len17to32(data, s, length):
    mul = _K2 + np.uint64(length) * np.uint64(2)
    return _hash_ends16(data, s, length, mul, _K1)[2]


@numba.njit(cache=True, nogil=True)
def _hash_len33to64(data, s, length):
    mul = _K2 + np.uint64(length) * np.uint64(2)
    a, y, z = _hash_ends16(data, s, length, mul, _K2)
    e = _fetch64(data, s + 16) * mul
    f = _fetch64(data, s + 24)
    g = (y + _fetch64(data, s + length - 32)) * mul
    h = (z + _fetch64(data, s + length - 24)) * mul
    return _hash_len16(_rotate(e + f, 43) + _rotate(g, 30) + h, e + _rotate(f + a, 18) + g, mul)


@numba.njit(cache=True, nogil=True, inline="always")
def _weak_hash_len32_with_seeds(data, s, a, b):
    w = _fetch64(data, s)
    x = _fetch64(data, s + 8)
    y = _fetch64(data, s + 16)
    z = _fetch64(data, s + 24)
    a += w
    b = _rotate(b + a + z, 21)
    c = a
    a += x
    a += y
    b += _rotate(a, 44)
    return a + z, b + c


@numba.njit(cache=True, nogil=True, inline="always")
def fingerprint64(data, start, length):
    """FarmHash Fingerprint64 of `data[start : start + length]` (`data`: uint8[n]), a uint64.

    Inlined where it is called, so that short ids (the common case) are
    hashed without a call.
    """
    if length <= 16:
        return _hash_len0to16(data, start, length)
    if length <= 32:
        return _hash_len17to32(data, start, length)
    if length <= 64:
        return _hash_len33to64(data, start, length)
    return _hash_len65plus(data, start, length)


@numba.njit(cache=True, nogil=True)
def _hash_len65plus(data, start, length):
    seed = np.uint64(81)
    x = seed
    y = seed * _K1 + np.uint64(113)
    z = _shift_mix(y * _K2 + np.uint64(113)) * _K2
    v0, v1, w0, w1 = np.uint64(0), np.uint64(0), np.uint64(0), np.uint64(0)
    x = x * _K2 + _fetch64(data, start)
    s = start
    end = start + ((length - 1) // 64) * 64
    last64 = start + length - 64
    while True:
        x = _rotate(x + y + v0 + _fetch64(data, s + 8), 37) * _K1
        y = _rotate(y + v1 + _fetch64(data, s + 48), 42) * _K1
        x ^= w1
        y += v0 + _fetch64(data, s + 40)
        z = _rotate(z + w0, 33) * _K1
        v0, v1 = _weak_hash_len32_with_seeds(data, s, v1 * _K1, x + w0)
        w0, w1 = _weak_hash_len32_with_seeds(data, s + 32, z + w1, y + _fetch64(data, s + 16))
        z, x = x, z
        s += 64
        if s == end:
            break
    mul = _K1 + ((z & np.uint64(0xFF)) << np.uint64(1))
    s = last64
    w0 += np.uint64((length - 1) & 63)
    v0 += w0
    w0 += v0
    x = _rotate(x + y + v0 + _fetch64(data, s + 8), 37) * mul
    y = _rotate(y + v1 + _fetch64(data, s + 48), 42) * mul
    x ^= w1 * np.uint64(9)
    y += v0 * np.uint64(9) + _fetch64(data, s + 40)
    z = _rotate(z + w0, 33) * mul
    v0, v1 = _weak_hash_len32_with_seeds(data, s, v1 * mul, x + w0)
    w0, w1 = _weak_hash_len32_with_seeds(data, s + 32, z + w1, y + _fetch64(data, s + 16))
    z, x = x, z
    return _hash_len16(
        _hash_len16(v0, w0, mul) + _shift_mix(y) * _K0 + z,
        _hash_len16(v1, w1, mul) + x,
        mul,
    )


def bucket_reciprocal(num_buckets: int) -> np.uint64:
    """`floor((2^64 - 1) / num_buckets)`, which `bucket` takes to spare a division."""
    return np.uint64((2**64 - 1) // num_buckets)


@numba.njit(cache=True, nogil=True, inline="always")
def _high_product(a, b):
    """The high 64 bits of the 128-bit product of the uint64s `a` and `b`."""
    low = np.uint64(0xFFFFFFFF)
    a_low, a_high = a & low, a >> np.uint64(32)
    b_low, b_high = b & low, b >> np.uint64(32)
    high_low = a_high * b_low
    middle = ((a_low * b_low) >> np.uint64(32)) + (high_low & low) + a_low * b_high
    return a_high * b_high + (high_low >> np.uint64(32)) + (middle >> np.uint64(32))


@numba.njit(cache=True, nogil=True, inline="always")
def bucket(value, num_buckets, reciprocal):
    """`value % num_buckets` (uint64s), `reciprocal` being `bucket_reciprocal(num_buckets)`.

    A 64-bit division takes tens of cycles, more than hashing a short id: the
    quotient is estimated from the reciprocal instead (Barrett reduction),
    at most 2 below the true one, and the remainder corrected.
    """
    remainder = value - _high_product(value, reciprocal) * num_buckets
    if remainder >= num_buckets:
        remainder -= num_buckets
    if remainder >= num_buckets:
        remainder -= num_buckets
    return remainder


@numba.njit(cache=True, nogil=True)
def _hash_buckets(data, offsets, num_buckets, reciprocal, out):
    for i in range(offsets.size - 1):
        fp = fingerprint64(data, offsets[i], offsets[i + 1] - offsets[i])
        out[i] = np.int64(bucket(fp, num_buckets, reciprocal))


def hash_bucket(strings: list[bytes], num_buckets: int) -> np.ndarray:
    """`int64[len(strings)]`: `Fingerprint64(s) % num_buckets` per string.

    Equals `tf.strings.to_hash_bucket_fast(strings, num_buckets)`.
    """
    lengths = np.fromiter(map(len, strings), np.int64, count=len(strings))
    offsets = np.zeros(len(strings) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    data = np.frombuffer(b"".join(strings), np.uint8)
    out = np.empty(len(strings), np.int64)
    _hash_buckets(data, offsets, np.uint64(num_buckets), bucket_reciprocal(num_buckets), out)
    return out
