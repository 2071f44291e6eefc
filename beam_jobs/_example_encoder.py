"""Serializes one-value-per-feature `tf.train.Example`s straight into protobuf wire format.

Building an `example_pb2.Example` costs a map insertion and a message per
feature, most of an import's time per line (docs/benchmarks.md); this writes
the same bytes from per-key prefixes computed once. The output equals
`Example.SerializeToString(deterministic=True)` (map entries in key order,
int64 lists packed; a test checks it):

    Example   { Features features = 1; }
    Features  { map<string, Feature> feature = 1; }   entry: key = 1, value = 2
    Feature   { BytesList bytes_list = 1; FloatList float_list = 2;
                Int64List int64_list = 3; }
    *List     { repeated ... value = 1; }   int64 as packed varints,
                                            float as packed fixed32
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from beam_jobs._columns import ColumnKind

_BYTES, _FLOAT, _INT64 = 1, 2, 3
_LEN = 2  # wire type of a length-delimited field
_FLOAT32 = struct.Struct("<f")


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # an int64 is a 10-byte varint of its two's complement
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return _varint(number << 3 | _LEN) + _varint(len(payload)) + payload


_SMALL_VARINTS = [bytes((v,)) for v in range(128)]


class ExampleEncoder:
    """Encodes a row of values (one per column, None for absent) as an Example.

    A feature's bytes are a prefix that depends only on its column and the
    length of its value's encoding, then that encoding: the prefixes are
    made once per (column, length) and kept.

    Args:
      keys: per column, its feature key.
      kinds: per column, its `ColumnKind` (int -> int64, float -> float,
        string and hex -> bytes).
    """

    def __init__(self, keys: Sequence[str], kinds: Sequence[ColumnKind]):
        # Deterministic serialization writes map entries in key order.
        self._order = sorted(range(len(keys)), key=lambda c: keys[c].encode())
        self._keys = [_field(1, key.encode()) for key in keys]
        self._kinds = [
            _INT64 if kind is ColumnKind.INT else _FLOAT if kind is ColumnKind.FLOAT else _BYTES
            for kind in kinds
        ]
        self._prefixes: list[dict[int, bytes]] = [{} for _ in keys]

    def _prefix(self, column: int, length: int) -> bytes:
        """The bytes of column's map entry before a value encoded in `length` bytes."""
        value_list = _varint(1 << 3 | _LEN) + _varint(length)  # then the value
        feature = _varint(self._kinds[column] << 3 | _LEN) + _varint(len(value_list) + length)
        entry = (
            self._keys[column]
            + _varint(2 << 3 | _LEN)
            + _varint(len(feature) + len(value_list) + length)
        )
        size = len(entry) + len(feature) + len(value_list) + length
        return _varint(1 << 3 | _LEN) + _varint(size) + entry + feature + value_list

    def encode(self, values: Sequence) -> bytes:
        """The Example's bytes; `values[c]` is an int, float, str or bytes, or None."""
        parts = []
        for c in self._order:
            value = values[c]
            if value is None:
                continue
            kind = self._kinds[c]
            if kind == _INT64:
                value = int(value)
                payload = _SMALL_VARINTS[value] if 0 <= value < 128 else _varint(value)
            elif kind == _FLOAT:
                payload = _FLOAT32.pack(value)
            else:
                payload = value if isinstance(value, bytes) else value.encode()
            prefixes = self._prefixes[c]
            prefix = prefixes.get(len(payload))
            if prefix is None:
                prefix = prefixes[len(payload)] = self._prefix(c, len(payload))
            parts.append(prefix)
            parts.append(payload)
        if not parts:
            return b""
        features = b"".join(parts)
        return _varint(1 << 3 | _LEN) + _varint(len(features)) + features
