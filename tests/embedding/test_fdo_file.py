"""The FDO stats file's strict schema: every bad file is one `FdoStatsError`."""

import copy
import json

import numpy as np
import pytest

import embedding

NAME = "fdo_stats-p00000-00000000000000000001.json"
HASH = "ab" * 32
# 2 devices x 2 partitions (N = 4), one host (L = 2): per-partition lists hold
# L * N = 8 entries (local device d, partition p at d * 4 + p), the buffer L * S = 4.
DOCUMENT = {
    "format": "sparseflow.fdo_stats",
    "version": 1,
    "config_hash": HASH,
    "geometry": {"global_batch_size": 16, "devices": 2, "partitions_per_device": 2, "processes": 1},
    "batches": 3,
    "stacks": {
        "t": {
            "max_ids_per_partition": [5, 0, 2, 1, 3, 3, 0, 8],
            "max_unique_ids_per_partition": [4, 0, 2, 1, 3, 1, 0, 8],
            # Slot (0, 0) held 5, 0, 2, 1 ids: 8 + 0 + 8 + 8 entries once padded to 8.
            "required_buffer_size_per_sc": [24, 16, 16, 24],
            "batch_max_percentiles": {
                "max_ids_per_partition": {"p50": 5, "p90": 8, "p99": 8, "p99.9": 8, "max": 8}
            },
            # Partition p's max over devices: 5, 3, 2, 8; every row counts the 3 batches.
            "partition_histogram": {
                "values": [0, 2, 3, 5, 8],
                "counts": [[0, 1, 0, 2, 0], [1, 0, 2, 0, 0], [2, 1, 0, 0, 0], [0, 0, 0, 0, 3]],
            },
        }
    },
    "tables": {"t": {"ids": 40, "distinct_ids": 12, "top_ids": [[3, 9], [0, 5]]}},
}
TEXT = json.dumps(DOCUMENT, separators=(",", ":"))
STACK = ("stacks", "t")
# The largest slot buffer S = 2 slots may take: the device's 2 * 1073741816
# entries stay within int32; a multiple of 8.
LARGEST_SLOT_BUFFER = 1073741816


_DELETE = object()


def _changed(path: tuple, value) -> dict:
    """A copy of DOCUMENT with the entry at `path` set to `value` (or deleted)."""
    document = copy.deepcopy(DOCUMENT)
    *parents, last = path
    node = document
    for key in parents:
        node = node[key]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return document


def _load(tmp_path, text: str) -> embedding.FdoStats:
    path = tmp_path / NAME
    path.write_text(text)
    return embedding.load_fdo_stats(path, expected_config_hash=HASH, expected_geometry=None)


def _assert_rejected(tmp_path, text: str, message: str) -> None:
    with pytest.raises(embedding.FdoStatsError) as raised:
        _load(tmp_path, text)
    assert str(raised.value).startswith(f"{tmp_path / NAME}: corrupt FDO stats file")
    assert message in str(raised.value)
    assert raised.value.path == str(tmp_path / NAME)


def test_the_hand_written_file_loads():
    stats = embedding.FdoStats.from_json(json.dumps(DOCUMENT))
    stack = stats.stacks["t"]
    np.testing.assert_array_equal(stack.required_buffer_size_per_sc, [24, 16, 16, 24])
    assert stack.partition_histogram.shape == (4, 9)
    np.testing.assert_array_equal(stack.partition_histogram[3], [0] * 8 + [3])
    assert stats.tables["t"].top_ids == ((3, 9), (0, 5))
    assert json.loads(stats.to_json()) == DOCUMENT


@pytest.mark.parametrize("seed", [None, 0, 2**32 - 1])
def test_the_batches_stats_cover_round_trip(seed):
    document = dict(DOCUMENT, batch_order={"records": 50, "shuffle_seed": seed, "epochs": 3})
    stats = embedding.FdoStats.from_json(json.dumps(document))
    order = embedding.FdoBatchOrder(records=50, shuffle_seed=seed, epochs=3)
    assert stats.batch_order == order
    assert json.loads(stats.to_json()) == document
    # They cover a run of the same records and seed over as many epochs or fewer.
    assert order.covers(embedding.FdoBatchOrder(records=50, shuffle_seed=seed, epochs=1))
    assert not order.covers(embedding.FdoBatchOrder(records=50, shuffle_seed=seed, epochs=4))
    assert not order.covers(embedding.FdoBatchOrder(records=51, shuffle_seed=seed, epochs=3))
    other_seed = 7 if seed is None else None
    assert not order.covers(embedding.FdoBatchOrder(records=50, shuffle_seed=other_seed, epochs=3))


def test_limit_raises_round_trip_and_are_matched_by_layout(tmp_path, caplog):
    geometry = embedding.FdoGeometry(global_batch_size=16, devices=2, partitions_per_device=2)
    layout = embedding.FdoLayout(entries={"tables.t.vocabulary_size": 10})
    raises = embedding.LimitRaises(
        layout_key=layout.key,
        geometry=geometry,
        stacks={
            "t": embedding.StackLimits(max_ids_per_partition=9, max_unique_ids_per_partition=4)
        },
        batches=(3, 7),
    )
    path = embedding.write_limit_raises(tmp_path, raises)
    assert path == str(tmp_path / "fdo_limit_raises.json")
    assert embedding.load_limit_raises(tmp_path, layout=layout, geometry=geometry) == raises
    # Next to a stats file, the same file.
    stats_file = tmp_path / NAME
    assert embedding.load_limit_raises(stats_file, layout=layout, geometry=geometry) == raises
    other = embedding.FdoLayout(entries={"tables.t.vocabulary_size": 11})
    assert embedding.load_limit_raises(tmp_path, layout=other, geometry=geometry) is None
    assert "limit raises of another batch layout" in caplog.text
    document = json.loads(raises.to_json())
    document["stacks"]["t"]["max_ids_per_partition"] = -1
    (tmp_path / "fdo_limit_raises.json").write_text(json.dumps(document))
    with pytest.raises(embedding.FdoStatsError, match=r"stacks\['t'\].max_ids_per_partition"):
        embedding.load_limit_raises(tmp_path, layout=layout, geometry=geometry)


def test_a_stack_at_the_largest_buffer_the_geometry_allows_loads(tmp_path):
    largest = _changed(STACK + ("required_buffer_size_per_sc",), [LARGEST_SLOT_BUFFER, 16, 16, 24])
    stats = _load(tmp_path, json.dumps(largest))
    limits = embedding.fdo_limits(stats, headroom=1.0, spread_margin=0.0)["t"]
    assert limits.suggested_coo_buffer_size_per_device == 2 * LARGEST_SLOT_BUFFER
    with pytest.raises(
        ValueError,
        match=r"'t': headroom 1.1 and spread margin 4 make a buffer of 2362232000 entries",
    ):
        embedding.fdo_limits(stats, headroom=1.1)


@pytest.mark.parametrize(
    "path, value, message",
    [
        # Values of a per-partition list.
        (
            STACK + ("max_ids_per_partition", 2),
            -1,
            "stacks['t'].max_ids_per_partition[2]: must be an integer in [0, 2147483647], got -1",
        ),
        (STACK + ("max_ids_per_partition", 2), 2.5, "max_ids_per_partition[2]: must be an integer"),
        (STACK + ("max_ids_per_partition", 2), 2.0, "max_ids_per_partition[2]: must be an integer"),
        (STACK + ("max_ids_per_partition", 2), "2", "got '2'"),
        (
            STACK + ("max_ids_per_partition", 2),
            True,
            "max_ids_per_partition[2]: must be an integer",
        ),
        (STACK + ("max_ids_per_partition", 2), None, "got None"),
        (STACK + ("max_ids_per_partition", 2), 2**64, "got 18446744073709551616"),
        (STACK + ("max_ids_per_partition", 2), [2], "max_ids_per_partition[2]: must be an integer"),
        # Bounds the geometry sets.
        (
            STACK + ("required_buffer_size_per_sc", 1),
            LARGEST_SLOT_BUFFER + 8,
            "stacks['t'].required_buffer_size_per_sc[1]: 1073741824 entries per slot take "
            "2147483648 per device (2 slots), over the 2147483647 int32 indices address",
        ),
        (
            STACK + ("required_buffer_size_per_sc", 1),
            2**31 - 1,
            "required_buffer_size_per_sc[1]: 2147483647 is not a multiple of 8",
        ),
        (
            STACK + ("max_ids_per_partition", 2),
            25,
            "stacks['t'].max_ids_per_partition[2]: 25 ids exceed the largest buffer of local "
            "device 0's slots, 24",
        ),
        (
            STACK + ("max_unique_ids_per_partition", 1),
            1,
            "stacks['t'].max_unique_ids_per_partition[1]: 1 distinct ids exceed the 0 ids of "
            "max_ids_per_partition[1]",
        ),
        # Lists of the wrong shape.
        (
            STACK + ("max_ids_per_partition",),
            [5, 0, 2],
            "max_ids_per_partition: must be a list of 8",
        ),
        (STACK + ("required_buffer_size_per_sc",), {"0": 24}, "must be a list of 4 integers"),
        # Wrong types or entries at each level.
        (("geometry",), [16, 2, 2, 1], "geometry: must be an object"),
        (("geometry", "devices"), "2", "geometry: FdoGeometry.devices must be a positive integer"),
        (("geometry", "processes"), _DELETE, "geometry: missing entry 'processes'"),
        (("batches",), -3, "batches: must be an integer in [0, 9223372036854775807], got -3"),
        (("batches",), 3.0, "batches: must be an integer"),
        (("config_hash",), 5, "config_hash: must be a string, got 5"),
        (("version",), True, "version: True is not the supported version 1; recompute"),
        (("stacks",), [], "stacks: must be an object"),
        (STACK, [], "stacks['t']: must be an object"),
        (STACK + ("max_id_per_partition",), [0] * 8, "stacks['t']: unknown entry 'max_id_per"),
        (STACK + ("required_buffer_size_per_sc",), _DELETE, "missing entry 'required_buffer"),
        (("extra",), 1, "unknown entry 'extra'"),
        # The offline summaries.
        (STACK + ("batch_max_percentiles",), [], "stacks['t'].batch_max_percentiles: must be an"),
        (
            STACK + ("batch_max_percentiles", "ids"),
            {},
            "stacks['t'].batch_max_percentiles: unknown entry 'ids'",
        ),
        (
            STACK + ("batch_max_percentiles", "max_ids_per_partition", "p90"),
            -8,
            "batch_max_percentiles['max_ids_per_partition']['p90']: must be an integer in [0,",
        ),
        (
            STACK + ("batch_max_percentiles", "max_ids_per_partition", "p90"),
            4,
            "batch_max_percentiles['max_ids_per_partition']: p90 4 is below p50 5",
        ),
        (
            STACK + ("batch_max_percentiles", "max_ids_per_partition", "max"),
            9,
            "batch_max_percentiles['max_ids_per_partition']: max 9 is not the largest "
            "max_ids_per_partition, 8",
        ),
        (STACK + ("partition_histogram",), [], "stacks['t'].partition_histogram: must be an"),
        (
            STACK + ("partition_histogram", "values"),
            [0, 2, 3, 5, 10**12],
            "partition_histogram.values[4]: must be an integer in [0, 2147483647], got 10000",
        ),
        (
            STACK + ("partition_histogram", "values"),
            [0, 2, 3, 5, 10**9],
            "partition_histogram.values[4]: 1000000000 exceeds the largest "
            "max_ids_per_partition, 8",
        ),
        (
            STACK + ("partition_histogram", "values"),
            [-5, 2, 3, 5, 8],
            "partition_histogram.values[0]: must be an integer in [0, 2147483647], got -5",
        ),
        (
            STACK + ("partition_histogram", "values"),
            [0, 3, 2, 5, 8],
            "partition_histogram.values[2]: 2 does not follow 3 in increasing order",
        ),
        (
            STACK + ("partition_histogram", "counts"),
            {},
            "partition_histogram.counts: must be a list of 4 lists",
        ),
        (
            STACK + ("partition_histogram", "counts", 1),
            5,
            "partition_histogram.counts[1]: must be a list of 5 integers",
        ),
        (
            STACK + ("partition_histogram", "counts", 1, 0),
            0.5,
            "partition_histogram.counts[1][0]: must be an integer",
        ),
        (
            STACK + ("partition_histogram", "counts", 1, 0),
            2,
            "stacks['t'].partition_histogram: partition 1 counts 4 batches, the stats cover 3",
        ),
        (
            STACK + ("partition_histogram", "counts", 2),
            [0, 0, 0, 0, 3],
            "stacks['t'].partition_histogram: partition 2 took 8 ids in a batch, more than "
            "its max_ids_per_partition, 2",
        ),
        (("tables",), [], "tables: must be an object"),
        (("tables", "t"), [], "tables['t']: must be an object"),
        (("tables", "t", "ids"), -40, "tables['t'].ids: must be an integer in [0,"),
        (("tables", "t", "top_ids"), {}, "tables['t'].top_ids: must be a list"),
        (("tables", "t", "top_ids", 0), 3, "tables['t'].top_ids[0]: must be a list of 2 integers"),
        (("tables", "t", "top_ids", 0), [3], "tables['t'].top_ids[0]: must be a list of 2"),
        (("tables", "t", "top_ids", 1, 1), "5", "tables['t'].top_ids[1][1]: must be an integer"),
        (("batch_order",), [], "batch_order: must be an object"),
        (
            ("batch_order",),
            {"records": 9, "shuffle_seed": 1},
            "batch_order: missing entry 'epochs'",
        ),
        (
            ("batch_order",),
            {"records": 9, "shuffle_seed": 2**32, "epochs": 1},
            "batch_order.shuffle_seed: must be an integer in [0, 4294967295]",
        ),
        (
            ("batch_order",),
            {"records": 9, "shuffle_seed": None, "epochs": 0},
            "FdoBatchOrder.epochs must be a positive integer, got 0",
        ),
    ],
)
def test_a_bad_entry_is_named(tmp_path, path, value, message):
    _assert_rejected(tmp_path, json.dumps(_changed(path, value)), message)


@pytest.mark.parametrize(
    "text, message",
    [
        (TEXT[:200], "not JSON"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        (TEXT.replace('"batches":3', '"batches":1' + "0" * 5000), "not JSON"),
        (TEXT.replace('"batches":3', '"batches":NaN'), "batches: must be an"),
        ("[]", "corrupt FDO stats file: must be an object, got list"),
        ("", "not JSON"),
    ],
    ids=["truncated", "deeply nested", "5000-digit integer", "NaN", "a list", "empty"],
)
def test_a_bad_text_is_named(tmp_path, text, message):
    _assert_rejected(tmp_path, text, message)


@pytest.mark.parametrize(
    "field, values, message",
    [
        ("max_ids_per_partition", np.full(8, 1.5), r"max_ids_per_partition: must be integers"),
        ("max_ids_per_partition", np.full(8, True), r"max_ids_per_partition: must be integers"),
        (
            "max_unique_ids_per_partition",
            np.r_[0, 0, -1, 0, 0, 0, 0, 0],
            r"max_unique_ids_per_partition\[2\]: must be in \[0, 2147483647\], got -1",
        ),
        (
            "required_buffer_size_per_sc",
            np.r_[0, 2**31, 0, 0],
            r"required_buffer_size_per_sc\[1\]: must be in \[0, 2147483647\], got 2147483648",
        ),
    ],
)
def test_stack_stats_take_no_value_they_would_truncate_or_wrap(field, values, message):
    fields = {
        "max_ids_per_partition": np.zeros(8, np.int64),
        "max_unique_ids_per_partition": np.zeros(8, np.int64),
        "required_buffer_size_per_sc": np.zeros(4, np.int64),
    }
    with pytest.raises(ValueError, match=message):
        embedding.StackFdoStats(**{**fields, field: values})


def test_a_histogram_too_large_to_hold_is_refused_before_it_is_allocated(tmp_path):
    # Partition 3 took up to 2**28 ids: consistent, but a dense histogram of
    # 4 x (2**28 + 1) int64 counts would take 8 GiB.
    document = _changed(STACK + ("required_buffer_size_per_sc",), [24, 16, 16, 2**28])
    stack = document["stacks"]["t"]
    stack["max_ids_per_partition"][7] = stack["max_unique_ids_per_partition"][7] = 2**28
    stack["batch_max_percentiles"]["max_ids_per_partition"]["max"] = 2**28
    stack["partition_histogram"]["values"][4] = 2**28
    _assert_rejected(
        tmp_path,
        json.dumps(document),
        "stacks['t'].partition_histogram: 4 partitions x 268435457 values make more than the "
        "134217728 counts a histogram may hold",
    )
