"""The compiled `tf.train.Example` reader (pipelines/_example_wire.py) vs `tf.io.parse_example`.

Records are encoded here by hand, byte by byte, so that every encoding the
wire format allows is drawn: packed and unpacked lists, entries and entry
fields in any order, features the layout does not read, values of the whole
int64 and float32 range (NaN payloads and signed zeros included). The reader
must give TensorFlow's result bit for bit, or refuse (None) the batches that
hold a record it must not vouch for.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embedding
import pipelines
from pipelines import _parse
from pipelines._example_wire import read_examples

FIXED = pipelines.RecordSchema.fixed(("a", "bb"), frozenset({"bb"}), 3)
LAYOUT = pipelines.FeatureLayout.from_schema(
    dataclasses.replace(
        FIXED,
        sparse=(
            *FIXED.sparse,
            pipelines.SparseColumn(name="s", key="s", ids="bytes", hash_buckets=1000),
        ),
    )
)
KEYS = ("a", "bb", "s", "bb_weights", "dense", "label")
ANOMALIES = (
    "missing label",
    "missing dense",
    "dense count",
    "two labels",
    "duplicate key",
    "feature without a list",
    "ids as floats",
    "features twice",
    "unknown example field",
    "truncated",
)


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _int64_list(values: list[int], packed: bool) -> bytes:
    if packed:
        return _field(1, b"".join(_varint(v) for v in values))
    return b"".join(_varint(1 << 3) + _varint(v) for v in values)


def _float_list(bits: list[int], packed: bool) -> bytes:
    raw = [np.uint32(b).tobytes() for b in bits]
    if packed:
        return _field(1, b"".join(raw))
    return b"".join(_varint(1 << 3 | 5) + r for r in raw)


INT64 = st.integers(-(2**63), 2**63 - 1)
FLOAT_BITS = st.integers(0, 2**32 - 1)


@st.composite
def records(draw, anomaly: str | None):
    lists = {
        "a": (3, _int64_list(draw(st.lists(INT64, max_size=5)), draw(st.booleans()))),
        "bb": (3, _int64_list(draw(st.lists(INT64, max_size=5)), draw(st.booleans()))),
        "bb_weights": (2, _float_list(draw(st.lists(FLOAT_BITS, max_size=5)), draw(st.booleans()))),
        "dense": (
            2,
            _float_list(draw(st.lists(FLOAT_BITS, min_size=3, max_size=3)), draw(st.booleans())),
        ),
        "label": (3, _int64_list([draw(st.sampled_from([0, 1, 7, -1]))], draw(st.booleans()))),
        "s": (
            1,
            b"".join(_field(1, v) for v in draw(st.lists(st.binary(max_size=200), max_size=3))),
        ),
        "other": (1, _field(1, b"bytes")),
    }
    for key in ("a", "bb", "s", "bb_weights"):
        if draw(st.integers(0, 5)) == 0:
            del lists[key]  # absent sparse features read as empty rows
    if anomaly == "missing label":
        del lists["label"]
    elif anomaly == "missing dense":
        del lists["dense"]
    elif anomaly == "dense count":
        lists["dense"] = (2, _float_list([0] * draw(st.sampled_from([2, 4])), True))
    elif anomaly == "two labels":
        lists["label"] = (3, _int64_list([0, 1], True))
    elif anomaly == "ids as floats":
        lists["a"] = (2, _float_list([0], True))
    entries, label = [], None
    for key, (kind, payload) in lists.items():
        label = len(entries) if key == "label" else label
        feature = (
            b"" if anomaly == "feature without a list" and key == "a" else _field(kind, payload)
        )
        fields = [_field(1, key.encode()), _field(2, feature)]
        entries.append(b"".join(fields if draw(st.booleans()) else fields[::-1]))
    if anomaly == "feature without a list" and "a" not in lists:
        entries.append(_field(1, b"a") + _field(2, b""))
    if anomaly == "duplicate key":
        entries.append(entries[label])
    order = draw(st.permutations(range(len(entries))))
    record = _field(1, b"".join(_field(1, entries[i]) for i in order))
    if anomaly == "features twice":
        record += _field(1, b"")
    elif anomaly == "unknown example field":
        record += _varint(2 << 3) + _varint(5)
    elif anomaly == "truncated":
        record = record[: draw(st.integers(1, len(record) - 1))]
    return record


@st.composite
def batches(draw):
    anomaly = draw(st.sampled_from((None, None, None) + ANOMALIES))
    size = draw(st.integers(1, 6))
    bad = draw(st.integers(0, size - 1)) if anomaly else -1
    return [draw(records(anomaly if row == bad else None)) for row in range(size)], anomaly


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_the_reader_equals_tensorflow_or_refuses(batch):
    records, anomaly = batch
    read = read_examples(records, _parse._wire_schema(LAYOUT))
    if anomaly is not None:
        assert read is None, anomaly
        return
    assert read is not None
    expected = _parse._tf_parse(records, LAYOUT)
    assert set(read) == set(expected) == set(KEYS)
    for key in KEYS:
        (values, splits), (want_values, want_splits) = read[key], expected[key]
        want_values = want_values.reshape(-1)
        assert values.dtype == want_values.dtype
        np.testing.assert_array_equal(values.view(np.uint8), want_values.view(np.uint8))
        if want_splits is not None:
            np.testing.assert_array_equal(splits, want_splits)


def test_records_the_writer_makes_take_the_compiled_path():
    batch = pipelines.ParsedBatch(
        ids={"a": _ragged([[1, 2], [3]]), "bb": _ragged([[5], [6, 7]])},
        weights={"bb": _ragged([[0.5], [1.0, 2.0]], np.float32)},
        dense=np.arange(6, dtype=np.float32).reshape(2, 3),
        labels=np.array([0, 1], np.int32),
    )
    records = _parse.serialize_examples(batch)
    assert read_examples(records, _parse._wire_schema(LAYOUT)) is not None
    parsed = pipelines.parse_examples(records, LAYOUT)
    np.testing.assert_array_equal(parsed.ids["bb"].values, [5, 6, 7])
    np.testing.assert_array_equal(parsed.weights["bb"].row_splits, [0, 1, 3])
    np.testing.assert_array_equal(parsed.dense, batch.dense)


@pytest.mark.parametrize("record", [b"", b"\x0a", b"\xff" * 12, b"\x0a\x02\x0a\x00"])
def test_malformed_bytes_are_refused_not_misread(record):
    assert read_examples([record], _parse._wire_schema(LAYOUT)) is None


def _ragged(rows, dtype=np.int64):
    values = np.array([v for row in rows for v in row], dtype)
    return embedding.RaggedIds(values, np.cumsum([0] + [len(r) for r in rows]))
