"""Tests of record files and record parsing (pipelines/_records.py, _parse.py)."""

import os
import pickle

import hypothesis
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import strategies as st

from embedding import RaggedIds
from pipelines import (
    BadRecordError,
    FeatureLayout,
    ParsedBatch,
    list_record_files,
    parse_examples,
    parse_examples_lenient,
    read_records,
)
from pipelines._parse import serialize_examples
from pipelines._records import RecordFileWriter

LAYOUT = FeatureLayout(sparse=("a", "b"), weighted=frozenset({"b"}), num_dense_features=2)


def _int64s(*values):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=values))


def _floats(*values):
    return tf.train.Feature(float_list=tf.train.FloatList(value=values))


def _example(**features):
    return tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString()


def _good_features(row=0):
    return {
        "a": _int64s(row, 2**40 + row),
        "b": _int64s(5, 6 + row),
        "b_weights": _floats(0.5, 2.0),
        "dense": _floats(1.5, -row),
        "label": _int64s(row % 2),
    }


def _assert_batches_equal(actual: ParsedBatch, expected: ParsedBatch):
    for field in ("ids", "weights"):
        actual_field, expected_field = getattr(actual, field), getattr(expected, field)
        assert list(actual_field) == list(expected_field), field
        for name, ragged in expected_field.items():
            np.testing.assert_array_equal(actual_field[name].values, ragged.values)
            np.testing.assert_array_equal(actual_field[name].row_splits, ragged.row_splits)
            assert actual_field[name].values.dtype == ragged.values.dtype
            assert actual_field[name].row_splits.dtype == np.int64
    np.testing.assert_array_equal(actual.dense, expected.dense)
    np.testing.assert_array_equal(actual.labels, expected.labels)
    assert actual.dense.dtype == np.float32 and actual.labels.dtype == np.int32


def test_parses_hand_built_examples():
    records = [
        _example(**_good_features(0)),
        _example(**{**_good_features(1), "a": _int64s()}),  # empty, but present
        # A feature with no list set reads as empty, as TF reads it.
        _example(**{**_good_features(2), "b": tf.train.Feature(), "b_weights": _floats()}),
        _example(**_good_features(3), unused=_floats(9.0)),
    ]
    expected = ParsedBatch(
        ids={
            "a": RaggedIds(
                np.array([0, 2**40, 2, 2**40 + 2, 3, 2**40 + 3]), np.array([0, 2, 2, 4, 6])
            ),
            "b": RaggedIds(np.array([5, 6, 5, 7, 5, 9]), np.array([0, 2, 4, 4, 6])),
        },
        weights={
            "b": RaggedIds(
                np.array([0.5, 2.0, 0.5, 2.0, 0.5, 2.0], np.float32), np.array([0, 2, 4, 4, 6])
            )
        },
        dense=np.array([[1.5, 0], [1.5, -1], [1.5, -2], [1.5, -3]], np.float32),
        labels=np.array([0, 1, 0, 1], np.int32),
    )
    _assert_batches_equal(parse_examples(records, LAYOUT), expected)
    _assert_batches_equal(parse_examples(np.array(records, dtype=object), LAYOUT), expected)


def test_without_dense_features_and_weights():
    layout = FeatureLayout(sparse=["a"])
    batch = parse_examples([_example(a=_int64s(3), label=_int64s(1))], layout)
    assert batch.dense.shape == (1, 0) and batch.weights == {}
    np.testing.assert_array_equal(batch.ids["a"].values, [3])


def test_empty_batch():
    batch = parse_examples([], LAYOUT)
    assert batch.dense.shape == (0, 2) and batch.labels.shape == (0,)
    np.testing.assert_array_equal(batch.ids["a"].row_splits, [0])


@st.composite
def _batches(draw):
    size = draw(st.integers(0, 6))
    num_dense = draw(st.integers(0, 3))
    ids, weights = {}, {}
    for name in ("x", "y"):
        lengths = draw(st.lists(st.integers(0, 4), min_size=size, max_size=size))
        splits = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
        count = int(splits[-1])
        values = draw(st.lists(st.integers(0, 2**62), min_size=count, max_size=count))
        ids[name] = RaggedIds(np.array(values, np.int64), splits)
    floats = st.floats(-1e6, 1e6, width=32)
    y_weights = draw(st.lists(floats, min_size=ids["y"].values.size, max_size=ids["y"].values.size))
    weights["y"] = RaggedIds(np.array(y_weights, np.float32), ids["y"].row_splits)
    dense = draw(st.lists(floats, min_size=size * num_dense, max_size=size * num_dense))
    labels = draw(st.lists(st.integers(0, 1), min_size=size, max_size=size))
    return ParsedBatch(
        ids=ids,
        weights=weights,
        dense=np.array(dense, np.float32).reshape(size, num_dense),
        labels=np.array(labels, np.int32),
    )


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(_batches())
def test_serialize_then_parse_round_trips(batch):
    layout = FeatureLayout(
        sparse=("x", "y"), weighted={"y"}, num_dense_features=batch.dense.shape[1]
    )
    _assert_batches_equal(parse_examples(serialize_examples(batch), layout), batch)


def _without(key):
    return lambda features: {k: v for k, v in features.items() if k != key}


def _with(key, feature):
    return lambda features: {**features, key: feature}


BAD_RECORDS = {
    "undecodable": (None, "not a serialized tf.train.Example"),
    "missing ids": (_without("a"), "missing feature 'a'"),
    "missing weights": (_without("b_weights"), "missing feature 'b_weights'"),
    "missing dense": (_without("dense"), "missing feature 'dense'"),
    "missing label": (_without("label"), "missing feature 'label'"),
    "float ids": (_with("a", _floats(1.0)), "feature 'a' holds a float_list, expected int64_list"),
    "empty float ids": (_with("a", _floats()), "feature 'a' holds a float_list"),
    "int weights": (_with("b_weights", _int64s(1, 1)), "holds a int64_list, expected float_list"),
    "bytes dense": (
        _with("dense", tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"1", b"2"]))),
        "feature 'dense' holds a bytes_list",
    ),
    "short dense": (_with("dense", _floats(1.0)), "has 1 values, expected num_dense_features = 2"),
    "long dense": (_with("dense", _floats(1, 2, 3)), "has 3 values, expected num_dense_features"),
    "label 2": (_with("label", _int64s(2)), "'label' is 2, expected 0 or 1"),
    "label -1": (_with("label", _int64s(-1)), "'label' is -1, expected 0 or 1"),
    "two labels": (_with("label", _int64s(0, 1)), "has 2 values, expected exactly 1"),
    "float label": (_with("label", _floats(1.0)), "'label' holds a float_list"),
    "weights count": (_with("b_weights", _floats(1.0)), "has 1 weights for 2 ids of 'b'"),
}


def _records_with_bad(case, bad_index, size=5):
    edit, _ = BAD_RECORDS[case]
    records = [_example(**_good_features(row)) for row in range(size)]
    bad = b"\xff\x00 not a proto" if edit is None else _example(**edit(_good_features(bad_index)))
    records[bad_index] = bad
    return records


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_bad_record_is_named(case):
    _, reason = BAD_RECORDS[case]
    records = _records_with_bad(case, bad_index=3)
    with pytest.raises(BadRecordError, match="index 3 of the batch") as raised:
        parse_examples(records, LAYOUT)
    assert raised.value.index == 3 and reason in raised.value.reason
    assert isinstance(raised.value, ValueError)

    batch, skipped = parse_examples_lenient(records, LAYOUT)
    assert [index for index, _ in skipped] == [3] and reason in skipped[0][1]
    good = records[:3] + records[4:]
    _assert_batches_equal(batch, parse_examples(good, LAYOUT))


def test_lenient_reports_every_bad_record_in_order():
    records = [_example(**_good_features(row)) for row in range(6)]
    records[1] = _records_with_bad("label 2", 1, size=6)[1]
    records[4] = _records_with_bad("float ids", 4, size=6)[4]
    records[5] = _records_with_bad("missing ids", 5, size=6)[5]
    batch, skipped = parse_examples_lenient(records, LAYOUT)
    assert [index for index, _ in skipped] == [1, 4, 5]
    np.testing.assert_array_equal(batch.dense[:, 1], [0, -2, -3])
    with pytest.raises(BadRecordError, match=r"index 1 of the batch.*\(2 more bad records"):
        parse_examples(records, LAYOUT)


def test_lenient_on_a_clean_batch_skips_nothing():
    records = [_example(**_good_features(row)) for row in range(3)]
    batch, skipped = parse_examples_lenient(records, LAYOUT)
    assert skipped == []
    _assert_batches_equal(batch, parse_examples(records, LAYOUT))


def test_bad_record_error_survives_pickling():
    error = pickle.loads(pickle.dumps(BadRecordError(7, "missing feature 'a'", 2)))
    assert (error.index, error.reason, error.others) == (7, "missing feature 'a'", 2)
    assert str(error) == str(BadRecordError(7, "missing feature 'a'", 2))


def test_records_must_be_bytes():
    with pytest.raises(TypeError, match="record 1 is a str"):
        parse_examples([_example(**_good_features()), "text"], LAYOUT)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(sparse=()), ValueError, "at least one sparse feature"),
        (dict(sparse="ab"), TypeError, "sequence of names"),
        (dict(sparse=("a", "")), ValueError, "non-empty strings"),
        (dict(sparse=("a",), weighted={"b"}), ValueError, "not sparse features"),
        (dict(sparse=("a", "a")), ValueError, "used twice"),
        (dict(sparse=("a", "label")), ValueError, "used twice"),
        (dict(sparse=("a",), num_dense_features=-1), ValueError, "num_dense_features"),
        (dict(sparse=("a",), num_dense_features=True), ValueError, "num_dense_features"),
    ],
)
def test_layout_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        FeatureLayout(**kwargs)


def test_layout_normalizes_its_fields():
    layout = FeatureLayout(sparse=["a", "b"], weighted=["b"], num_dense_features=1)
    assert layout.sparse == ("a", "b") and layout.weighted == frozenset({"b"})
    assert layout.record_keys() == ["a", "b", "b_weights", "dense", "label"]
    assert hash(layout) == hash(
        FeatureLayout(sparse=("a", "b"), weighted={"b"}, num_dense_features=1)
    )


# Record files.

RECORDS = [f"record {i}".encode() * (i % 3 + 1) for i in range(50)]


def _write(path, records=RECORDS):
    with RecordFileWriter(path) as writer:
        for record in records:
            writer.write(record)
    return str(path)


@pytest.mark.parametrize("extension", [".array_record", ".tfrecord"])
def test_read_records_returns_what_was_written(tmp_path, extension):
    first = _write(tmp_path / f"one{extension}")
    second = _write(tmp_path / f"two{extension}", RECORDS[:7])
    empty = _write(tmp_path / f"zero{extension}", [])
    assert list(read_records(first)) == RECORDS
    assert list(read_records([second, empty, first])) == RECORDS[:7] + RECORDS
    assert sorted(os.listdir(tmp_path)) == sorted(
        f"{name}{extension}" for name in ("one", "two", "zero")
    )


@pytest.mark.parametrize("extension", [".array_record", ".tfrecord"])
def test_failed_write_leaves_no_file(tmp_path, extension):
    with pytest.raises(RuntimeError, match="stop"):
        with RecordFileWriter(tmp_path / f"x{extension}") as writer:
            writer.write(b"record")
            raise RuntimeError("stop")
    assert os.listdir(tmp_path) == []


def _truncated(data):
    return data[: len(data) // 2]


def _flipped(data):
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]


def _garbage(data):
    return b"this is not a record file" * 10


@pytest.mark.parametrize("extension", [".array_record", ".tfrecord"])
@pytest.mark.parametrize("damage", [_truncated, _flipped, _garbage])
def test_corrupt_file_is_named(tmp_path, extension, damage):
    path = _write(tmp_path / f"data{extension}")
    with open(path, "rb") as file:
        data = file.read()
    with open(path, "wb") as file:
        file.write(damage(data))
    with pytest.raises(ValueError, match=f"{path}: corrupt or truncated"):
        list(read_records(path))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.tfrecord"):
        list(read_records(str(tmp_path / "nothere.tfrecord")))


def test_read_records_rejects_unknown_extension(tmp_path):
    with pytest.raises(ValueError, match="must end in one of"):
        list(read_records(str(tmp_path / "data.csv")))


@pytest.fixture
def record_tree(tmp_path):
    """tmp/ar/{b,a}.array_record, tmp/ar/.hidden.array_record, tmp/tf/c.tfrecord."""
    for name in ("ar/b.array_record", "ar/a.array_record", "ar/.hidden.array_record"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        _write(tmp_path / name, RECORDS[:2])
    (tmp_path / "tf").mkdir()
    _write(tmp_path / "tf" / "c.tfrecord", RECORDS[:2])
    (tmp_path / "notes.txt").write_text("not records")
    return tmp_path


def test_list_record_files(record_tree):
    ar, tf_file = str(record_tree / "ar"), str(record_tree / "tf" / "c.tfrecord")
    expected_ar = [os.path.join(ar, "a.array_record"), os.path.join(ar, "b.array_record")]
    assert list_record_files(ar) == expected_ar
    assert list_record_files(record_tree / "ar") == expected_ar
    assert list_record_files(os.path.join(ar, "*.array_record")) == expected_ar
    assert list_record_files([tf_file, ar]) == [tf_file, *expected_ar]
    assert list_record_files(str(record_tree / "*" / "*record")) == [*expected_ar, tf_file]


@pytest.mark.parametrize(
    "data, match",
    [
        ("nothing/*.tfrecord", "No files match"),
        ("missing.tfrecord", "No files match"),
        ("notes.txt", "is not a record file"),
        ("*", "is not a record file"),
        (".", r"holds no record files .* subdirectories .*ar.*tf.* pass one of them"),
        (["ar", "ar/a.array_record"], "listed twice"),
        ([], "No record files given"),
    ],
)
def test_list_record_files_errors(record_tree, data, match, monkeypatch):
    monkeypatch.chdir(record_tree)
    with pytest.raises(ValueError, match=match):
        list_record_files(data)


def test_empty_directory_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="holds no record files"):
        list_record_files(str(tmp_path))
