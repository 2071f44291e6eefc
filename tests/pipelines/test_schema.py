"""Records read through a `RecordSchema` (pipelines/_schema.py, _parse.py, _fingerprint.py).

References: `tf.strings.to_hash_bucket_fast` for hashed ids, numpy float64
for the dense transforms, the generator's own values for the rest; the
compiled path is compared bit for bit with the `tf.io.parse_example` one.
"""

import numba
import numpy as np
import pipeline_cases as cases
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import pipelines
from pipelines import _parse
from pipelines._example_wire import read_examples
from pipelines._fingerprint import bucket, bucket_reciprocal, hash_bucket

SCHEMA = pipelines.RecordSchema(
    sparse=(
        pipelines.SparseColumn(name="user", key="uid", ids="bytes", hash_buckets=1000),
        pipelines.SparseColumn(name="item", key="iid", weights_key="iw"),
        pipelines.SparseColumn(name="tag", key="t", ids="bytes", hash_buckets=7, required=True),
    ),
    dense=(
        pipelines.DenseColumn(key="count", type="int", default=0, transform="log1p"),
        pipelines.DenseColumn(key="price"),
        pipelines.DenseColumn(key="vec", length=3, default=0.5),
    ),
    label=pipelines.LabelColumn(key="clicked", type="float", threshold=0.3),
)
LAYOUT = pipelines.FeatureLayout.from_schema(SCHEMA)


def _int64s(*values):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=values))


def _floats(*values):
    return tf.train.Feature(float_list=tf.train.FloatList(value=values))


def _bytes(*values):
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=values))


def _example(features):
    return tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString()


def _random_string(rng):
    length = int(rng.choice([0, 1, 3, 5, 8, 12, 16, 17, 31, 33, 64, 65, 130]))
    return rng.integers(0, 256, length, dtype=np.uint8).tobytes()


def _random_rows(rng, size):
    """`size` rows of values (None: key left out) and their records."""
    rows, records = [], []
    for _ in range(size):
        row = {
            "uid": None
            if rng.random() < 0.3
            else [_random_string(rng) for _ in range(rng.integers(0, 4))],
            "iid": [int(v) for v in rng.integers(-(2**62), 2**62, rng.integers(0, 4))],
            "t": [_random_string(rng) for _ in range(rng.integers(0, 3))],
            "count": None if rng.random() < 0.3 else [int(rng.integers(-5, 10**6))],
            "price": [float(np.float32(rng.normal()))],
            "vec": None
            if rng.random() < 0.3
            else [float(v) for v in rng.normal(size=3).astype(np.float32)],
            "clicked": [float(np.float32(rng.random()))],
        }
        row["iw"] = [float(np.float32(w)) for w in rng.random(len(row["iid"]))]
        features = {"unused": _floats(1.0)}
        for key, values in row.items():
            if values is None:
                continue
            if key in ("uid", "t"):
                features[key] = _bytes(*values)
            elif key in ("iid", "count"):
                features[key] = _int64s(*values)
            else:
                features[key] = _floats(*values)
        rows.append(row)
        records.append(_example(features))
    return rows, records


def _tf_hash(strings, buckets):
    if not strings:
        return np.zeros(0, np.int64)
    return tf.strings.to_hash_bucket_fast(tf.constant(strings, tf.string), buckets).numpy()


def test_fingerprint_equals_tensorflow_on_every_length_class():
    rng = np.random.default_rng(0)
    strings = [b""] + [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in range(1, 300)]
    strings += [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (511, 512, 513, 4096)]
    strings += [b"%08x" % v for v in rng.integers(0, 2**32, 2000)]  # Criteo-like hex ids
    strings += ["naïve café".encode(), b"\x00" * 70]
    for buckets in (1, 7, 1000, 2**31 - 1, 2**63 - 1):
        np.testing.assert_array_equal(hash_bucket(strings, buckets), _tf_hash(strings, buckets))


@numba.njit
def _buckets(values, num_buckets, reciprocal):
    return [bucket(v, num_buckets, reciprocal) for v in values]


@settings(deadline=None)  # the first example compiles
@given(
    st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=20),
    st.one_of(st.integers(1, 2**63 - 1), st.sampled_from([1, 2, 3, 7, 2**32, 2**63 - 1])),
)
def test_bucket_is_the_remainder(values, num_buckets):
    edges = [
        0,
        1,
        num_buckets - 1,
        num_buckets,
        2**64 - 1,
        (2**64 - 1) // num_buckets * num_buckets,
    ]
    values = values + [v for v in edges if 0 <= v < 2**64]
    got = _buckets(
        np.array(values, np.uint64), np.uint64(num_buckets), bucket_reciprocal(num_buckets)
    )
    assert [int(v) for v in got] == [v % num_buckets for v in values]


def test_parse_follows_the_schema():
    rows, records = _random_rows(np.random.default_rng(1), 40)
    batch = pipelines.parse_examples(records, LAYOUT)
    for name, key, buckets in (("user", "uid", 1000), ("tag", "t", 7)):
        for i, row in enumerate(rows):
            got = batch.ids[name].values[
                batch.ids[name].row_splits[i] : batch.ids[name].row_splits[i + 1]
            ]
            np.testing.assert_array_equal(got, _tf_hash(row[key] or [], buckets))
    np.testing.assert_array_equal(batch.ids["item"].values, [v for r in rows for v in r["iid"]])
    np.testing.assert_array_equal(
        batch.weights["item"].values, np.float32([w for r in rows for w in r["iw"]])
    )
    count = np.array([(r["count"] or [0])[0] for r in rows], np.float64)
    vec = np.array([r["vec"] or [0.5] * 3 for r in rows], np.float64)
    price = np.array([r["price"][0] for r in rows], np.float64)
    expected = np.column_stack([np.log1p(np.maximum(count, 0)), price, vec])
    np.testing.assert_allclose(batch.dense, expected, rtol=1e-6)
    assert batch.dense.shape == (40, LAYOUT.num_dense_features) == (40, 5)
    np.testing.assert_array_equal(batch.labels, [int(r["clicked"][0] > 0.3) for r in rows])


def test_compiled_path_equals_tensorflow_bit_for_bit(monkeypatch):
    _, records = _random_rows(np.random.default_rng(2), 64)
    read = read_examples(records, _parse._wire_schema(LAYOUT))
    assert read is not None, "valid records must take the compiled path"
    expected = _parse._tf_parse(records, LAYOUT)
    assert set(read) == set(expected) == set(SCHEMA.record_keys())
    for key, (values, splits) in read.items():
        assert values.dtype == expected[key][0].dtype, key
        np.testing.assert_array_equal(values.view(np.uint8), expected[key][0].view(np.uint8))
        np.testing.assert_array_equal(splits, expected[key][1])
    fast = pipelines.parse_examples(records, LAYOUT)
    monkeypatch.setattr(_parse, "read_examples", lambda records, schema: None)
    slow = pipelines.parse_examples(records, LAYOUT)
    for name in fast.ids:
        np.testing.assert_array_equal(fast.ids[name].values, slow.ids[name].values)
        np.testing.assert_array_equal(fast.ids[name].row_splits, slow.ids[name].row_splits)
    np.testing.assert_array_equal(
        fast.weights["item"].values.view(np.uint32), slow.weights["item"].values.view(np.uint32)
    )
    np.testing.assert_array_equal(fast.dense.view(np.uint32), slow.dense.view(np.uint32))
    np.testing.assert_array_equal(fast.labels, slow.labels)


def _one(**changes):
    features = {
        "uid": _bytes(b"u"),
        "iid": _int64s(3),
        "iw": _floats(1.0),
        "t": _bytes(b"x"),
        "price": _floats(2.0),
        "clicked": _floats(0.5),
    }
    features.update(changes)
    return _example({k: v for k, v in features.items() if v is not None})


def test_missing_optional_feature_has_no_ids():
    batch = pipelines.parse_examples([_one(uid=None, iid=None, iw=None), _one()], LAYOUT)
    np.testing.assert_array_equal(batch.ids["user"].row_splits, [0, 0, 1])
    np.testing.assert_array_equal(batch.ids["item"].row_splits, [0, 0, 1])
    np.testing.assert_array_equal(batch.weights["item"].row_splits, [0, 0, 1])


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"t": None}, "missing feature 't'"),
        ({"price": None}, "missing feature 'price'"),
        ({"price": _floats(float("nan"))}, "feature 'price' holds a non-finite value nan"),
        ({"vec": _floats(1.0, float("inf"), 2.0)}, "feature 'vec' holds a non-finite value inf"),
        ({"vec": _floats(1.0, 2.0)}, "feature 'vec' has 2 values, expected length = 3"),
        ({"uid": _int64s(4)}, "feature 'uid' holds a int64_list, expected bytes_list"),
        ({"count": _floats(1.5)}, "feature 'count' holds a float_list, expected int64_list"),
        ({"iw": _floats(1.0, 2.0)}, "feature 'iw' has 2 weights for 1 ids of 'iid'"),
        ({"clicked": _floats(float("nan"))}, "feature 'clicked' is nan, expected a finite number"),
        ({"clicked": _int64s(1)}, "feature 'clicked' holds a int64_list, expected float_list"),
        ({"clicked": None}, "missing feature 'clicked'"),
    ],
)
def test_bad_record_is_named_raised_or_skipped(changes, reason):
    records = [_one(), _one(), _one(**changes), _one()]
    with pytest.raises(pipelines.BadRecordError, match="index 2") as error:
        pipelines.parse_examples(records, LAYOUT)
    assert error.value.reason == reason
    batch, problems = pipelines.parse_examples_lenient(records, LAYOUT)
    assert problems == [(2, reason)]
    assert batch.labels.shape == (3,) and np.isfinite(batch.dense).all()


def test_standardize_needs_moments_and_applies_them():
    schema = pipelines.RecordSchema(
        sparse=(pipelines.SparseColumn(name="item", key="iid"),),
        dense=(pipelines.DenseColumn(key="price", transform="standardize"),),
    )
    records = [
        _example({"iid": _int64s(1), "price": _floats(v), "label": _int64s(0)}) for v in (1.0, 4.0)
    ]
    with pytest.raises(ValueError, match="'price' is standardized, but the layout has no mean"):
        pipelines.parse_examples(records, pipelines.FeatureLayout.from_schema(schema))
    layout = pipelines.FeatureLayout.from_schema(schema.with_moments({"price": ([2.0], [0.5])}))
    np.testing.assert_allclose(pipelines.parse_examples(records, layout).dense[:, 0], [-2.0, 4.0])
    raw = pipelines.FeatureLayout.from_schema(schema.without_standardization())
    np.testing.assert_array_equal(pipelines.parse_examples(records, raw).dense[:, 0], [1.0, 4.0])


MIXED_DENSE = (
    pipelines.DenseColumn(key="a", type="int", default=1, transform="log1p"),
    pipelines.DenseColumn(key="b", transform="standardize", mean=(1.0,), std=(2.0,)),
    pipelines.DenseColumn(
        key="c", length=2, default=-1.5, transform="standardize", mean=(0.0, -1.0), std=(4, 0.5)
    ),
    pipelines.DenseColumn(key="d", type="int", default=3),
    pipelines.DenseColumn(key="e", length=2),
    pipelines.DenseColumn(key="f", transform="log1p"),
)


def _mixed_dense_rows(rng, size, *, missing):
    """`size` rows `{key: values or None}` of MIXED_DENSE; keys with a default are
    left out of some rows when `missing`."""
    rows = []
    for _ in range(size):
        row = {
            "a": [int(rng.integers(-3, 10**5))],
            "b": [float(np.float32(rng.normal()))],
            "c": [float(v) for v in rng.normal(size=2).astype(np.float32)],
            "d": [int(rng.integers(-(2**40), 2**40))],
            "e": [float(v) for v in rng.normal(size=2).astype(np.float32)],
            "f": [float(np.float32(rng.normal()))],
        }
        for key in ("a", "c", "d"):
            if missing and rng.random() < 0.4:
                row[key] = None
        rows.append(row)
    return rows


def _mixed_dense_expected(rows):
    """float64 reference of MIXED_DENSE's dense input."""
    out = []
    for row in rows:
        a = (row["a"] or [1])[0]
        c = np.array(row["c"] or [-1.5, -1.5], np.float64)
        out.append(
            [
                np.log1p(max(a, 0)),
                (row["b"][0] - 1.0) / 2.0,
                *((c - [0.0, -1.0]) / [4.0, 0.5]),
                float(np.float32((row["d"] or [3])[0])),
                *row["e"],
                np.log1p(max(row["f"][0], 0.0)),
            ]
        )
    return np.array(out)


@pytest.mark.parametrize("missing", [False, True])
def test_dense_keys_of_every_kind_equal_numpy(monkeypatch, missing):
    schema = pipelines.RecordSchema(
        sparse=(pipelines.SparseColumn(name="item", key="iid"),), dense=MIXED_DENSE
    )
    layout = pipelines.FeatureLayout.from_schema(schema)
    rows = _mixed_dense_rows(np.random.default_rng(3), 50, missing=missing)
    records = []
    for row in rows:
        features = {"iid": _int64s(1), "label": _int64s(0)}
        for key, values in row.items():
            if values is not None:
                features[key] = _int64s(*values) if key in ("a", "d") else _floats(*values)
        records.append(_example(features))
    fast = pipelines.parse_examples(records, layout)
    assert fast.dense.shape == (50, 8) and fast.dense.dtype == np.float32
    np.testing.assert_allclose(fast.dense, _mixed_dense_expected(rows), rtol=1e-6, atol=1e-7)
    monkeypatch.setattr(_parse, "read_examples", lambda records, schema: None)
    slow = pipelines.parse_examples(records, layout)
    np.testing.assert_array_equal(fast.dense.view(np.uint32), slow.dense.view(np.uint32))


@pytest.mark.parametrize("missing", [False, True])
def test_dense_keys_all_log1p_equal_numpy(missing):
    schema = pipelines.RecordSchema(
        sparse=(pipelines.SparseColumn(name="item", key="iid"),),
        dense=tuple(
            pipelines.DenseColumn(key=key, type="int", default=2, transform="log1p")
            for key in ("I1", "I2", "I3")
        ),
    )
    rng = np.random.default_rng(4)
    rows = [{key: int(rng.integers(-5, 10**6)) for key in ("I1", "I2", "I3")} for _ in range(40)]
    if missing:
        for row in rows[::3]:
            del row["I2"]
    records = [
        _example({"iid": _int64s(1), "label": _int64s(1), **{k: _int64s(v) for k, v in r.items()}})
        for r in rows
    ]
    raw = np.array([[r.get(k, 2) for k in ("I1", "I2", "I3")] for r in rows], np.float64)
    dense = pipelines.parse_examples(records, pipelines.FeatureLayout.from_schema(schema)).dense
    np.testing.assert_allclose(dense, np.log1p(np.maximum(raw, 0)), rtol=1e-6)


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: pipelines.SparseColumn(name="f", key="f", ids="bytes"),
            "hash_buckets .the vocabulary size. is required",
        ),
        (
            lambda: pipelines.SparseColumn(name="f", key="f", ids="str"),
            "'str' is not a valid IdType",
        ),
        (lambda: pipelines.DenseColumn(key="d", default=float("nan")), "default must be finite"),
        (
            lambda: pipelines.RecordSchema(sparse=(pipelines.SparseColumn(name="f", key="label"),)),
            r"record keys \['label'\] are read twice",
        ),
    ],
)
def test_schema_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_without_a_schema_the_layout_is_the_fixed_one():
    layout = pipelines.FeatureLayout(
        sparse=("a", "b"), weighted=frozenset({"b"}), num_dense_features=2
    )
    assert layout.schema == pipelines.RecordSchema.fixed(("a", "b"), frozenset({"b"}), 2)
    assert layout.record_keys() == ["a", "b", "b_weights", "dense", "label"]
    assert all(column.required for column in layout.schema.sparse)


def _pipeline_records(count: int, nan_rows: set[int]) -> list[bytes]:
    records = []
    for row in range(count):
        price = float("nan") if row in nan_rows else float(row)
        records.append(
            _example(
                {
                    "uid": _bytes(b"user-%d" % (row % 5)),
                    "p": _floats(price),
                    "y": _int64s(row % 2),
                }
            )
        )
    return records


PIPELINE_LAYOUT = pipelines.FeatureLayout.from_schema(
    pipelines.RecordSchema(
        sparse=(pipelines.SparseColumn(name="a", key="uid", ids="bytes", hash_buckets=64),),
        dense=(pipelines.DenseColumn(key="p"),),
        label=pipelines.LabelColumn(key="y"),
    )
)


def _pipeline_config(**overrides):
    specs = {"a": cases.feature_specs(16)["a"]}
    return pipelines.PreprocessConfig(
        feature_specs=specs,
        layout=PIPELINE_LAYOUT,
        local_device_count=2,
        global_device_count=2,
        num_sc_per_device=2,
        **overrides,
    )


def test_nan_dense_value_is_skipped_and_counted_or_raised(tmp_path):
    records = _pipeline_records(48, nan_rows={5, 20})
    files = cases.write_records(str(tmp_path), records)["arrayrecord"]
    batching = pipelines.BatchingConfig(global_batch_size=16)
    with pipelines.make_grain_iterator(
        files, batching=batching, preprocess=_pipeline_config(on_bad_record="skip")
    ) as iterator:
        batches = list(iterator)
        stats = iterator.stats()
    assert stats["bad_records"] == 2
    assert all(np.isfinite(np.asarray(batch.dense)).all() for batch in batches)
    with pytest.raises(
        pipelines.InputRecordError, match="feature 'p' holds a non-finite value nan"
    ):
        with pipelines.make_grain_iterator(
            files, batching=batching, preprocess=_pipeline_config()
        ) as iterator:
            list(iterator)
