"""A compiled reader of serialized `tf.train.Example`s for one `RecordSchema`.

`tf.io.parse_example` costs a few hundred microseconds of call overhead and
its own threads per batch, more than the reading: a batch of a few hundred
records is a few hundred kilobytes of protobuf wire format, which one
compiled pass over the bytes decodes in a fraction of that. This reader
handles the records that `tf.io.parse_example` reads without complaint and
that use the plain encoding of the schema (`_schema.py`); anything else
(a duplicated or unknown field, a wrong value type, a missing dense feature
or label, a list of the wrong length, malformed bytes) makes it answer None,
and the caller parses the batch with TensorFlow, which also names the bad
records. Its results equal TensorFlow's (a property test checks it);
bytes values are hashed as `tf.strings.to_hash_bucket_fast` does
(`_fingerprint.py`).

The wire format read (protobuf field numbers):

    Example   { Features features = 1; }
    Features  { map<string, Feature> feature = 1; }   entries: key = 1, value = 2
    Feature   { oneof { BytesList = 1; FloatList = 2; Int64List = 3; } }
    BytesList { repeated bytes value = 1; }  one length-delimited field per value
    Int64List { repeated int64 value = 1; }  packed varints or one varint per field
    FloatList { repeated float value = 1; }  packed fixed32 or one fixed32 per field
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np

from pipelines._fingerprint import bucket, bucket_reciprocal, fingerprint64
from pipelines._record_batch import RecordBatch

BYTES_LIST = 1
INT64_LIST = 3
FLOAT_LIST = 2
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
_UNSURE = -1

# The compiled functions run without numba's reference counting (`_nrt=False`;
# they allocate nothing): otherwise each use of an array in a loop may take
# an atomic increment and decrement of its count, which cost more than the
# parsing. `_locate`'s helpers are inlined by numba (`inline="always"`): a call
# passes each array as several arguments and costs more, per map entry, than
# reading the entry.


class WireSchema:
    """The keys to read and their value types, as the compiled reader takes them.

    Args:
      keys: record keys, in output order.
      kinds: per key, `INT64_LIST`, `FLOAT_LIST` or `BYTES_LIST`.
      exact_counts: per key, the number of values every record must hold, or
        -1 for any number (absent keys then read as empty).
      buckets: per key, the hash buckets of a `BYTES_LIST` (each value reads
        as `Fingerprint64(value) % buckets`); ignored for the other kinds.
    """

    def __init__(
        self,
        keys: list[str],
        kinds: list[int],
        exact_counts: list[int],
        buckets: list[int] | None = None,
    ):
        encoded = [key.encode() for key in keys]
        self.keys = keys
        self.key_bytes = np.frombuffer(b"".join(encoded), np.uint8).copy()
        self.key_offsets = np.cumsum([0] + [len(key) for key in encoded]).astype(np.int64)
        self.kinds = np.asarray(kinds, np.int64)
        self.exact_counts = np.asarray(exact_counts, np.int64)
        self.buckets = np.asarray(buckets or [0] * len(keys), np.uint64)
        self.reciprocals = np.array(
            [bucket_reciprocal(int(b)) if b else 0 for b in self.buckets], np.uint64
        )


def read_examples(records: Sequence[bytes], schema: WireSchema) -> dict | None:
    """`{key: (values, row_splits)}` for every schema key, or None when unsure.

    Values are `int64[nnz]` (int64 lists, hashed bytes lists) or `float32[nnz]`,
    row splits `int64[batch + 1]`. A `RecordBatch` is read in place.
    """
    batch = RecordBatch.of(records)
    data, offsets = batch.data, batch.offsets
    num_keys = schema.kinds.size
    spans = np.zeros((len(records), num_keys, 2), np.int64)
    splits = np.zeros((num_keys, len(records) + 1), np.int64)  # counts, then their sums
    order = np.full(num_keys + 2, num_keys, np.int64)  # see _key_index
    if not _locate(
        data, offsets, schema.key_bytes, schema.key_offsets, schema.kinds, spans, splits, order
    ):
        return None
    exact = schema.exact_counts >= 0
    if (splits[exact, 1:] != schema.exact_counts[exact, None]).any():
        return None
    np.cumsum(splits, axis=1, out=splits)
    starts = np.zeros(num_keys + 1, np.int64)
    np.cumsum(splits[:, -1], out=starts[1:])
    values = np.empty(starts[-1], np.int64)
    ends = starts[:-1].copy()
    _decode(data, spans, schema.kinds, schema.buckets, schema.reciprocals, ends, values)
    out = {}
    for k, key in enumerate(schema.keys):
        key_values = values[starts[k] : starts[k + 1]]
        if schema.kinds[k] == FLOAT_LIST:
            key_values = key_values.astype(np.uint32).view(np.float32)
        out[key] = (key_values, splits[k])
    return out


@numba.njit(cache=True, nogil=True, _nrt=False)
def read_varint(data, position, end):
    """`(value, next position)`, or `(0, -1)` when the varint runs past `end` or 10 bytes."""
    value = np.uint64(0)
    shift = np.uint64(0)
    while position < end and shift < 70:
        byte = data[np.uint64(position)]  # unsigned: no wraparound branch (_fingerprint._byte)
        position += 1
        value |= np.uint64(byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += np.uint64(7)
    return np.uint64(0), -1


@numba.njit(cache=True, nogil=True, _nrt=False, inline="always")
def _field_end(data, position, end, wire_type):
    """The position after a field's payload starting at `position`, or -1 when malformed."""
    if wire_type == _VARINT:
        _, position = read_varint(data, position, end)
        return position
    if wire_type == _FIXED64:
        return position + 8 if position + 8 <= end else -1
    if wire_type == _FIXED32:
        return position + 4 if position + 4 <= end else -1
    if wire_type == _LEN:
        return _payload(data, position, end)[1]
    return -1


@numba.njit(cache=True, nogil=True, _nrt=False, inline="always")
def _payload(data, position, end):
    """`(start, stop)` of the length-delimited payload whose length is at `position`,
    or `(-1, -1)` when malformed or running past `end`."""
    length, position = read_varint(data, position, end)
    if position < 0 or length > np.uint64(end - position):
        return -1, -1
    return position, position + np.int64(length)


@numba.njit(cache=True, nogil=True, _nrt=False, inline="always")
def _is_key(data, start, stop, key_bytes, key_offsets, k):
    """Whether `data[start:stop]` is the schema's key `k`."""
    size = key_offsets[k + 1] - key_offsets[k]
    if size != stop - start:
        return False
    for j in range(size):
        if data[start + j] != key_bytes[key_offsets[k] + j]:
            return False
    return True


@numba.njit(cache=True, nogil=True, _nrt=False, inline="always")
def _key_index(data, start, stop, key_bytes, key_offsets, order):
    """The schema index of the key `data[start:stop]`, or -1.

    Records of one writer list their keys in one order (a map's, not the
    schema's): `order[k]` is the key that followed key `k` last time
    (`order[num_keys]`: the first key of a record), and `order[num_keys + 1]`
    the key matched last. Trying the key that followed it last time finds
    the key at once, instead of after comparing it with half the keys.
    """
    num_keys = key_offsets.size - 1
    previous = order[num_keys + 1]
    guess = order[previous]
    if guess < num_keys and _is_key(data, start, stop, key_bytes, key_offsets, guess):
        order[num_keys + 1] = guess
        return guess
    for k in range(num_keys):
        if _is_key(data, start, stop, key_bytes, key_offsets, k):
            order[previous] = k
            order[num_keys + 1] = k
            return k
    return -1


@numba.njit(cache=True, nogil=True, _nrt=False, inline="always")
def _count_values(data, start, stop, kind):
    """Values of an Int64List / FloatList payload, or -1 when it holds anything unexpected."""
    count = 0
    position = start
    while position < stop:
        if kind == BYTES_LIST and data[position] == 0x0A and position + 1 < stop:
            length = np.int64(data[position + 1])
            if length < 0x80:  # a value shorter than 128 bytes, read in place
                position += 2 + length
                if position > stop:
                    return _UNSURE
                count += 1
                continue
        tag, position = read_varint(data, position, stop)
        if position < 0 or np.int64(tag >> np.uint64(3)) != 1:
            return _UNSURE
        wire_type = np.int64(tag & np.uint64(7))
        if kind == BYTES_LIST:
            if wire_type != _LEN:
                return _UNSURE
            position = _payload(data, position, stop)[1]
            if position < 0:
                return _UNSURE
            count += 1
        elif wire_type == _LEN:
            position, block_end = _payload(data, position, stop)
            if position < 0:
                return _UNSURE
            if kind == FLOAT_LIST:
                if (block_end - position) % 4:
                    return _UNSURE
                count += (block_end - position) // 4
            else:
                run = 0  # bytes of the current varint: at most 10
                for j in range(position, block_end):
                    run += 1
                    if data[j] < 0x80:
                        count += 1
                        run = 0
                    elif run == 10:
                        return _UNSURE
                if run:
                    return _UNSURE
            position = block_end
        elif (kind == INT64_LIST and wire_type == _VARINT) or (
            kind == FLOAT_LIST and wire_type == _FIXED32
        ):
            position = _field_end(data, position, stop, wire_type)
            if position < 0:
                return _UNSURE
            count += 1
        else:
            return _UNSURE
    return count


@numba.njit(cache=True, nogil=True, _nrt=False, inline="always")
def _read_entry(data, start, stop, key_bytes, key_offsets, kinds, spans, counts, record, order):
    """Reads one map entry of Features; False when unsure."""
    key_start, key_stop, value_start, value_stop = -1, -1, -1, -1
    position = start
    # The plain encoding, key then value, each shorter than 128 bytes, read in place.
    if stop - start >= 4 and data[start] == 0x0A and data[start + 1] < 0x80:
        key_stop = start + 2 + np.int64(data[start + 1])
        if key_stop + 2 <= stop and data[key_stop] == 0x12 and data[key_stop + 1] < 0x80:
            if key_stop + 2 + np.int64(data[key_stop + 1]) == stop:
                key_start, value_start, value_stop = start + 2, key_stop + 2, stop
                position = stop
    while position < stop:
        tag, position = read_varint(data, position, stop)
        if position < 0:
            return False
        field, wire_type = np.int64(tag >> np.uint64(3)), np.int64(tag & np.uint64(7))
        if wire_type != _LEN or field < 1 or field > 2:
            return False
        payload, payload_end = _payload(data, position, stop)
        if payload < 0:
            return False
        if field == 1:
            if key_start >= 0:
                return False
            key_start, key_stop = payload, payload_end
        else:
            if value_start >= 0:
                return False
            value_start, value_stop = payload, payload_end
        position = payload_end
    if key_start < 0 or value_start < 0:
        return False
    k = _key_index(data, key_start, key_stop, key_bytes, key_offsets, order)
    if k < 0:
        return True  # a feature the layout does not read
    if spans[record, k, 1] > 0:
        return False  # the same key twice
    # The Feature: exactly one list, of the expected kind.
    if (
        value_stop - value_start >= 2
        and data[value_start] == kinds[k] << 3 | _LEN
        and data[value_start + 1] < 0x80
        and np.int64(data[value_start + 1]) == value_stop - value_start - 2
    ):
        list_start, list_end = value_start + 2, value_stop  # a list shorter than 128 bytes
    else:
        tag, position = read_varint(data, value_start, value_stop)
        if (
            position < 0
            or np.int64(tag & np.uint64(7)) != _LEN
            or np.int64(tag >> np.uint64(3)) != kinds[k]
        ):
            return False
        list_start, list_end = _payload(data, position, value_stop)
        if list_start < 0 or list_end != value_stop:
            return False
    count = _count_values(data, list_start, list_end, kinds[k])
    if count < 0:
        return False
    spans[record, k, 0] = list_start
    spans[record, k, 1] = list_end
    counts[k, record + 1] = count
    return True


@numba.njit(cache=True, nogil=True, _nrt=False)
def _locate(data, offsets, key_bytes, key_offsets, kinds, spans, counts, order):
    """Finds each record's lists of the schema's keys, counts their values; False when unsure.

    `spans[record, k]` becomes the `(start, stop)` of key `k`'s list in the
    record, `counts[k, record + 1]` its count of values.
    """
    num_keys = key_offsets.size - 1
    for record in range(offsets.size - 1):
        position, end = offsets[record], offsets[record + 1]
        order[num_keys + 1] = num_keys
        seen_features = False
        while position < end:
            tag, position = read_varint(data, position, end)
            if position < 0 or tag != np.uint64(1 << 3 | _LEN) or seen_features:
                return False
            seen_features = True
            position, features_end = _payload(data, position, end)
            if position < 0:
                return False
            while position < features_end:
                tag, position = read_varint(data, position, features_end)
                if position < 0 or tag != np.uint64(1 << 3 | _LEN):
                    return False
                entry_start, entry_end = _payload(data, position, features_end)
                if entry_start < 0:
                    return False
                if not _read_entry(
                    data,
                    entry_start,
                    entry_end,
                    key_bytes,
                    key_offsets,
                    kinds,
                    spans,
                    counts,
                    record,
                    order,
                ):
                    return False
                position = entry_end
    return True


@numba.njit(cache=True, nogil=True, _nrt=False)
def _decode(data, spans, kinds, buckets, reciprocals, ends, out):
    """Decodes each key's list payloads `spans[record, k]` into `out[ends[k]:]`,
    in record order, `ends[k]` moving past them: one call for all keys, as a
    call per key costs more than decoding a scalar key, and record by record,
    reading `spans` in its order.

    Int64List values as they are; FloatList values as their float32 bits;
    BytesList values as `Fingerprint64(value) % buckets[k]`.
    """
    for record in range(spans.shape[0]):
        for k in range(kinds.size):
            position, stop = spans[record, k, 0], spans[record, k, 1]
            if position == stop:
                continue
            kind = kinds[k]
            j = ends[k]
            while kind == BYTES_LIST and position < stop:
                # `_locate` checked the encoding; a tag and a length of one byte
                # (ids shorter than 128 bytes) are read in place.
                if data[position] == 0x0A and data[position + 1] < 0x80:
                    start = position + 2
                    position = start + np.int64(data[position + 1])
                else:
                    position = read_varint(data, position, stop)[1]
                    start, position = _payload(data, position, stop)
                fp = fingerprint64(data, start, position - start)
                out[j] = np.int64(bucket(fp, buckets[k], reciprocals[k]))
                j += 1
            while position < stop:
                if data[position] == 0x0A and data[position + 1] < 0x80:
                    single = False  # a packed block shorter than 128 bytes
                    end = position + 2 + np.int64(data[position + 1])
                    position += 2
                else:
                    tag, position = read_varint(data, position, stop)
                    single = np.int64(tag & np.uint64(7)) != _LEN
                    end = position
                    if not single:
                        length, position = read_varint(data, position, stop)
                        end = position + np.int64(length)
                while single or position < end:
                    single = False
                    if kind == FLOAT_LIST:
                        out[j] = (
                            np.int64(data[position])
                            | np.int64(data[position + 1]) << 8
                            | np.int64(data[position + 2]) << 16
                            | np.int64(data[position + 3]) << 24
                        )
                        position += 4
                    else:
                        value, position = read_varint(data, position, stop)
                        out[j] = np.int64(value)
                    j += 1
            ends[k] = j
