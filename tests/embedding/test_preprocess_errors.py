"""Bad input to the preprocessing: clear exceptions that name what was wrong."""

import functools
import re

import numpy as np
import pytest

import embedding

Table = functools.partial(
    embedding.TableSpec,
    embedding_dim=8,
    initializer=embedding.initializers.Constant(0.0),
    optimizer=embedding.SGDOptimizerSpec(),
    combiner="sum",
)
IDS = np.array([[1, 2], [3, 4], [5, 6], [7, 8]])


def _feature(table=None, batch=4, name="f"):
    table = table or Table(name="t", vocabulary_size=10, max_ids_per_partition=8)
    return embedding.FeatureSpec(
        name=name, table_spec=table, input_shape=[batch, 2], output_shape=[batch, 8]
    )


def _preprocess(ids, weights=None, specs=None, *, local=1, global_=1, slots=2, **kwargs):
    return embedding.preprocess_sparse_dense_matmul_input(
        ids,
        weights,
        {"f": _feature()} if specs is None else specs,
        local,
        global_,
        num_sc_per_device=slots,
        **kwargs,
    )


def _ragged(rows):
    out = np.empty(len(rows), dtype=object)
    out[:] = [np.asarray(r) for r in rows]
    return out


@pytest.mark.parametrize("bad_id", [10, 11, 2**40, -1, -7])
def test_id_outside_vocabulary_names_feature_and_row(bad_id):
    ids = IDS.copy()
    ids[2, 1] = bad_id
    with pytest.raises(ValueError, match=rf"Feature 'f', row 2: id {bad_id} is outside \[0, 10\)"):
        _preprocess({"f": ids})


def test_invalid_id_policy_drop_counts_and_keeps_the_rest():
    ids = _ragged([[1, 2], [3, 10], [-1, 6], [7, 8]])
    out, stats = _preprocess({"f": ids}, invalid_id_policy="drop")
    clean, clean_stats = _preprocess({"f": _ragged([[1, 2], [3], [6], [7, 8]])})
    assert stats.invalid_id_counters == {"t": 2}
    assert stats.id_drop_counters == {"t": 0}
    assert clean_stats.invalid_id_counters == {"t": 0}
    for got, want in zip(out.sparse_dense_matmul_input, clean.sparse_dense_matmul_input):
        np.testing.assert_array_equal(got["t"], want["t"])


def test_unknown_invalid_id_policy():
    with pytest.raises(ValueError, match="ignore"):
        _preprocess({"f": IDS}, invalid_id_policy="ignore")


@pytest.mark.parametrize("bad", [4.5, np.nan, np.inf])
def test_non_integer_float_id(bad):
    ids = IDS.astype(np.float64)
    ids[1, 1] = bad
    with pytest.raises(ValueError, match=r"Feature 'f', row 1: id .* is not an integer"):
        _preprocess({"f": ids})


def test_integral_float_ids_are_accepted():
    out, _ = _preprocess({"f": IDS.astype(np.float32)})
    want, _ = _preprocess({"f": IDS})
    np.testing.assert_array_equal(out.lhs_embedding_ids["t"], want.lhs_embedding_ids["t"])


def test_string_ids_are_rejected():
    with pytest.raises((TypeError, ValueError), match="Feature 'f'"):
        _preprocess({"f": IDS.astype(str)})


@pytest.mark.parametrize("bad", [np.nan, -0.5, np.inf, -np.inf])
def test_bad_weight_names_feature_and_row(bad):
    weights = np.ones(IDS.shape)
    weights[3, 0] = bad
    with pytest.raises(ValueError, match=r"Feature 'f', row 3: weight .* is not a finite number"):
        _preprocess({"f": IDS}, {"f": weights})


@pytest.mark.parametrize("rows", [3, 5, 8])
def test_wrong_row_count(rows):
    ids = np.arange(rows * 2).reshape(rows, 2) % 10
    with pytest.raises(ValueError, match=f"Feature 'f': got {rows} rows, expected .* 4"):
        _preprocess({"f": ids})


def test_wrong_row_count_with_two_hosts():
    # G = 2 devices, L = 1 on this host: the host holds 8 * 1 / 2 = 4 rows.
    specs = {"f": _feature(batch=8)}
    with pytest.raises(ValueError, match="got 8 rows, expected the host-local batch of 4"):
        _preprocess({"f": np.zeros((8, 2), int)}, specs=specs, global_=2, slots=1)


@pytest.mark.parametrize(
    ("weights", "detail"),
    [
        (_ragged([[1.0, 1.0], [1.0], [1.0, 1.0], [1.0, 1.0]]), "row 1 has 1 weights for 2 ids"),
        (np.ones((4, 3)), "row 0 has 3 weights for 2 ids"),
        (np.ones((3, 2)), "3 weight rows for 4 id rows"),
    ],
)
def test_weights_not_matching_ids(weights, detail):
    with pytest.raises(ValueError, match=re.escape(detail)):
        _preprocess({"f": IDS}, {"f": weights})


def _breach_specs(max_ids: int, max_unique: int) -> dict:
    table = Table(
        name="t",
        vocabulary_size=16,
        max_ids_per_partition=max_ids,
        max_unique_ids_per_partition=max_unique,
    )
    return {"f": _feature(table, batch=8)}


# L = G = S = 2, N = 4, 2 samples per slot: rows 6 and 7 are device 1, slot 1,
# and their ids 3 and 7 both land in partition 3 (two entries, two columns);
# every other (slot, partition) holds at most one entry.
BREACH_IDS = np.array([[0], [1], [0], [1], [2], [3], [3], [7]])


@pytest.mark.parametrize(
    ("max_ids", "max_unique", "limit"),
    [(1, 8, "max_ids_per_partition"), (8, 1, "max_unique_ids_per_partition")],
)
def test_limit_breach_names_table_device_slot_partition(max_ids, max_unique, limit):
    specs = _breach_specs(max_ids, max_unique)
    with pytest.raises(embedding.LimitBreachError) as info:
        _preprocess({"f": BREACH_IDS}, specs=specs, local=2, global_=2, slots=2)
    message = str(info.value)
    assert "Table 't', local device 1, slot 1, partition 3" in message
    assert limit in message
    assert isinstance(info.value, ValueError)


def test_limit_breach_with_dropping_allowed_is_counted():
    _, stats = _preprocess(
        {"f": BREACH_IDS},
        specs=_breach_specs(1, 8),
        local=2,
        global_=2,
        slots=2,
        allow_id_dropping=True,
    )
    assert stats.id_drop_counters == {"t": 1}
    assert stats.max_ids_per_partition["t"].tolist() == [1, 1, 0, 0, 0, 0, 1, 2]


def test_buffer_too_small_without_dropping():
    # N = 1; 9 distinct ids need 9 entries, the suggested buffer holds 8.
    table = Table(
        name="t",
        vocabulary_size=10,
        max_ids_per_partition=64,
        suggested_coo_buffer_size_per_device=8,
    )
    ids = _ragged([[0, 1], [2, 3], [4, 5], [6, 7, 8]])
    with pytest.raises(ValueError, match=r"Table 't'.*suggested_coo_buffer_size_per_device"):
        _preprocess({"f": ids}, specs={"f": _feature(table)}, slots=1)


def test_unknown_sharding_strategy():
    with pytest.raises(ValueError, match="sharding_strategy 'DIV'"):
        _preprocess({"f": IDS}, sharding_strategy="DIV")


def test_minibatching_on_several_hosts_needs_an_all_reduce_interface():
    # G = 2 devices, L = 1 here: another host exists and must agree on splits.
    with pytest.raises(ValueError, match="needs all_reduce_interface"):
        _preprocess(
            {"f": IDS},
            specs={"f": _feature(batch=8)},
            global_=2,
            slots=1,
            enable_minibatching=True,
        )


@pytest.mark.parametrize(
    "features",
    [{"g": IDS}, {"f": IDS, "g": IDS}, [IDS], (IDS,), IDS],
    ids=["other key", "extra key", "list", "tuple", "bare array"],
)
def test_features_structure_must_match_specs(features):
    with pytest.raises(ValueError, match="structure of features does not match feature_specs"):
        _preprocess(features)


def test_weights_structure_must_match_specs():
    with pytest.raises(ValueError, match="structure of features_weights"):
        _preprocess({"f": IDS}, {"g": np.ones(IDS.shape)})


@pytest.mark.parametrize(("global_", "slots"), [(3, 1), (1, 3), (2, 3), (3, 2)])
def test_partition_count_must_be_a_power_of_two(global_, slots):
    specs = {"f": _feature(batch=12)}
    with pytest.raises(ValueError, match=f"N = .* = {global_ * slots} must be a power of two"):
        _preprocess(
            {"f": np.zeros((12 // global_, 2), int)},
            specs=specs,
            global_=global_,
            slots=slots,
        )


@pytest.mark.parametrize(
    ("batch", "local", "global_", "slots"),
    [(6, 1, 1, 4), (4, 1, 1, 8), (6, 2, 2, 2), (4, 1, 2, 4)],
)
def test_batch_must_split_over_devices_and_slots(batch, local, global_, slots):
    specs = {"f": _feature(batch=batch)}
    rows = batch * local // global_
    with pytest.raises(ValueError, match=f"global batch {batch} must split evenly"):
        _preprocess(
            {"f": np.zeros((rows, 2), int)},
            specs=specs,
            local=local,
            global_=global_,
            slots=slots,
        )


def test_local_devices_must_divide_global_devices():
    with pytest.raises(ValueError, match="local_device_count 2 must divide global_device_count 1"):
        _preprocess({"f": IDS}, local=2, global_=1)


@pytest.mark.parametrize("count", [0, -2, 1.5])
def test_device_counts_must_be_positive_integers(count):
    with pytest.raises(ValueError, match="global_device_count must be a positive integer"):
        _preprocess({"f": IDS}, global_=count)


def test_ragged_row_splits_must_cover_values():
    bad = embedding.RaggedIds(values=np.arange(8), row_splits=np.array([0, 2, 4, 6, 7]))
    with pytest.raises(ValueError, match="Feature 'f'.*row_splits"):
        _preprocess({"f": bad})
