"""FDO stats files, the FDO client and the limits they set (embedding/_fdo_*.py)."""

import dataclasses
import json
import logging
import math
import os

import numpy as np
import pytest

import embedding
from embedding import initializers

GLOBAL_BATCH = 64
DEVICES, SLOTS, PROCESSES = 4, 2, 2
LOCAL = DEVICES // PROCESSES
N = DEVICES * SLOTS
GEOMETRY = embedding.FdoGeometry(
    global_batch_size=GLOBAL_BATCH,
    devices=DEVICES,
    partitions_per_device=SLOTS,
    processes=PROCESSES,
)
HASH = "ab" * 32
VOCABULARY = {"ta": 1000, "tb": 200, "tc": 300, "td": 100}
FEATURES = {"a": ("ta", 5), "b": ("tb", 1), "c": ("tb", 4), "d": ("tc", 3), "e": ("td", 2)}


def _specs():
    tables = {
        name: embedding.TableSpec(
            name=name,
            vocabulary_size=size,
            embedding_dim=8,
            initializer=initializers.Constant(0.0),
            optimizer=embedding.SGDOptimizerSpec(learning_rate=0.1),
            combiner="sum",
            max_ids_per_partition=256,
            max_unique_ids_per_partition=256,
        )
        for name, size in VOCABULARY.items()
    }
    specs = {
        name: embedding.FeatureSpec(
            name=name,
            table_spec=tables[table],
            input_shape=[GLOBAL_BATCH, valency],
            output_shape=[GLOBAL_BATCH, 8],
        )
        for name, (table, valency) in FEATURES.items()
    }
    return embedding.stack_tables(specs, ["tc", "td"], DEVICES, SLOTS)


STACKS = ("ta", "tb", "tc_td")


def _host_batches(seed: int, batches: int):
    """Per batch, per host, `{feature: RaggedIds}` of Zipf ids."""
    rng = np.random.default_rng(seed)
    rows = GLOBAL_BATCH // PROCESSES
    result = []
    for _ in range(batches):
        hosts = []
        for _ in range(PROCESSES):
            features = {}
            for name, (table, valency) in FEATURES.items():
                lengths = rng.integers(1, valency + 1, rows)
                values = (rng.zipf(1.2, lengths.sum()) - 1) % VOCABULARY[table]
                features[name] = embedding.RaggedIds(
                    values, np.concatenate([[0], np.cumsum(lengths)])
                )
            hosts.append(features)
        result.append(hosts)
    return result


def _preprocess(features, specs, *, allow_id_dropping=True):
    return embedding.preprocess_sparse_dense_matmul_input(
        features,
        None,
        specs,
        local_device_count=LOCAL,
        global_device_count=DEVICES,
        num_sc_per_device=SLOTS,
        allow_id_dropping=allow_id_dropping,
    )[1]


def _stack_stats(value: int, processes: int = PROCESSES, **extras) -> embedding.StackFdoStats:
    local = DEVICES // processes
    return embedding.StackFdoStats(
        max_ids_per_partition=np.full(local * N, value),
        max_unique_ids_per_partition=np.full(local * N, value // 2),
        required_buffer_size_per_sc=np.full(local * SLOTS, 8 * value),
        **extras,
    )


def _stats(value: int = 10, *, config_hash=HASH, geometry=GEOMETRY, **extras) -> embedding.FdoStats:
    return embedding.FdoStats(
        config_hash=config_hash,
        geometry=geometry,
        batches=3,
        stacks={name: _stack_stats(value, geometry.processes, **extras) for name in STACKS},
    )


def _document(stats: embedding.FdoStats) -> dict:
    return json.loads(stats.to_json())


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"devices": 3}, "power of two"),
        ({"processes": 3}, "cannot share 4 devices"),
        ({"global_batch_size": 60}, "multiple of devices x partitions_per_device = 8"),
        ({"partitions_per_device": 0}, "partitions_per_device must be a positive integer"),
    ],
)
def test_geometry_rejects_bad_values(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(GEOMETRY, **changes)


def test_stats_file_round_trip_with_offline_summaries():
    histogram = np.zeros((N, 12), np.int64)
    histogram[:, [3, 11]] = [2, 1]  # every partition: 3 batches
    percentiles = {"max_ids_per_partition": {"p50": 3, "p90": 5, "p99": 11, "p99.9": 11, "max": 11}}
    stats = dataclasses.replace(
        _stats(11, batch_max_percentiles=percentiles, partition_histogram=histogram),
        tables={
            "ta": embedding.TableIdFrequency(ids=90, distinct_ids=40, top_ids=((0, 20), (3, 9)))
        },
    )
    loaded = embedding.FdoStats.from_json(stats.to_json())
    assert _document(loaded) == _document(stats)
    assert loaded.tables == stats.tables
    np.testing.assert_array_equal(loaded.stacks["ta"].partition_histogram, histogram)
    assert loaded.stacks["ta"].max_ids_per_partition.dtype == np.int32
    # The histogram is stored sparsely: only the values some partition took.
    stored = json.loads(stats.to_json())["stacks"]["ta"]["partition_histogram"]
    assert stored["values"] == [3, 11]


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not JSON"),
        ('{"format": "other"}', "format: must be 'sparseflow.fdo_stats', got 'other'"),
        ('{"format": "sparseflow.fdo_stats", "version": 9}', "version: 9 is not the supported"),
        ('{"format": "sparseflow.fdo_stats", "version": 1}', "missing entry 'config_hash'"),
    ],
)
def test_corrupt_stats_text_names_the_source_and_the_problem(text, message):
    with pytest.raises(
        embedding.FdoStatsError, match=f"^stats.json: corrupt FDO stats file.*{message}"
    ):
        embedding.FdoStats.from_json(text, source="stats.json")


def test_stats_reject_arrays_of_another_geometry():
    with pytest.raises(
        ValueError,
        match=r"stacks\['ta'\]\.max_ids_per_partition: has shape \(32,\), expected \(16,\)",
    ):
        embedding.FdoStats(
            config_hash=HASH, geometry=GEOMETRY, batches=1, stacks={"ta": _stack_stats(1, 1)}
        )


def test_client_round_trip_and_merge_across_processes(tmp_path):
    specs = _specs()
    clients = [
        embedding.FdoClient(tmp_path, config_hash=HASH, geometry=GEOMETRY, process_index=p)
        for p in range(PROCESSES)
    ]
    recorded = []
    for hosts in _host_batches(seed=1, batches=4):
        for client, features in zip(clients, hosts):
            stats = _preprocess(features, specs)
            client.record(stats)
            recorded.append(stats)
    paths = [client.publish() for client in clients]
    assert [os.path.basename(p).split("-")[1] for p in paths] == ["p00000", "p00001"]
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]

    own = embedding.load_fdo_stats(paths[1], expected_config_hash=HASH, expected_geometry=GEOMETRY)
    assert own.batches == 4
    merged = clients[0].load()
    assert merged.batches == 4 and sorted(merged.stacks) == sorted(STACKS)
    for stack in STACKS:
        for field in (
            "max_ids_per_partition",
            "max_unique_ids_per_partition",
            "required_buffer_size_per_sc",
        ):
            expected = np.max([getattr(s, field)[stack] for s in recorded], axis=0)
            np.testing.assert_array_equal(getattr(merged.stacks[stack], field), expected)


def test_load_takes_the_newest_file_of_every_source(tmp_path):
    embedding.write_fdo_stats(_stats(50), tmp_path, source="p00000")
    embedding.write_fdo_stats(_stats(20), tmp_path, source="p00000")
    embedding.write_fdo_stats(_stats(30), tmp_path, source="p00001")
    embedding.write_fdo_stats(_stats(5), tmp_path, source="offline")
    loaded = embedding.load_fdo_stats(
        tmp_path, expected_config_hash=HASH, expected_geometry=GEOMETRY
    )
    assert int(loaded.stacks["ta"].max_ids_per_partition.max()) == 30


def test_client_checks_what_it_records_and_publishes(tmp_path):
    client = embedding.FdoClient(tmp_path, config_hash=HASH, geometry=GEOMETRY, process_index=0)
    one_local_device = embedding.SparseDenseMatmulInputStats(
        max_ids_per_partition={"ta": np.zeros(N, np.int32)},
        max_unique_ids_per_partition={"ta": np.zeros(N, np.int32)},
        required_buffer_size_per_sc={"ta": np.zeros(SLOTS, np.int32)},
    )
    with pytest.raises(ValueError, match="FdoClient.record: stats do not fit the geometry"):
        client.record(one_local_device)
    with pytest.raises(ValueError, match="no stats recorded yet"):
        client.publish()
    with pytest.raises(ValueError, match=r"process_index 2 is outside \[0, 2\)"):
        embedding.FdoClient(tmp_path, config_hash=HASH, geometry=GEOMETRY, process_index=2)


@pytest.mark.parametrize(
    "write, message",
    [
        (lambda d: None, "no FDO stats files"),
        (
            lambda d: (d / "fdo_stats-p00000-00000000000000000001.json").write_text('{"format"'),
            "fdo_stats-p00000-00000000000000000001.json: corrupt FDO stats file",
        ),
        (
            lambda d: (d / "fdo_stats-p00000-00000000000000000001.json").write_text("[" * 100_000),
            "fdo_stats-p00000-00000000000000000001.json: corrupt FDO stats file: nested too deeply",
        ),
        (
            lambda d: embedding.write_fdo_stats(_stats(config_hash="cd" * 32), d, source="p00000"),
            "computed for config hash cdcdcdcdcdcdcdcd..., expected abababababababab",
        ),
        (
            lambda d: embedding.write_fdo_stats(
                _stats(geometry=dataclasses.replace(GEOMETRY, processes=1)), d, source="p00000"
            ),
            "another batch geometry: processes 1 in the file, 2 expected",
        ),
    ],
    ids=["missing", "corrupt", "deeply nested", "other config", "other geometry"],
)
def test_bad_stats_files_raise_or_default_with_a_warning(tmp_path, caplog, write, message):
    write(tmp_path)
    with pytest.raises(embedding.FdoStatsError, match=message):
        embedding.load_fdo_stats(tmp_path, expected_config_hash=HASH, expected_geometry=GEOMETRY)
    client = embedding.FdoClient(tmp_path, config_hash=HASH, geometry=GEOMETRY)
    with caplog.at_level(logging.WARNING, logger="embedding.fdo._client"):
        assert client.load(on_mismatch="warn_and_default") is None
    assert message.split(":")[0] in caplog.text and "using the configured limits" in caplog.text


def test_a_missing_path_is_named(tmp_path):
    with pytest.raises(embedding.FdoStatsError, match="nowhere.json: no such FDO stats file"):
        embedding.load_fdo_stats(
            tmp_path / "nowhere.json", expected_config_hash=None, expected_geometry=None
        )


def test_fdo_limits_hand_case():
    stats = embedding.FdoStats(
        config_hash=HASH,
        geometry=GEOMETRY,
        batches=1,
        stacks={
            "ta": embedding.StackFdoStats(
                max_ids_per_partition=np.r_[2000, np.zeros(LOCAL * N - 2, int), 7],
                max_unique_ids_per_partition=np.r_[np.zeros(LOCAL * N - 1, int), 7],
                required_buffer_size_per_sc=[2000, 8, 0, 16],
            ),
            "tb": _stack_stats(0),
        },
    )
    limits = embedding.fdo_limits(stats, headroom=1.1)
    # Large counts take the headroom: 2000 x 1.1 = 2200 exactly (not 2201 from
    # float rounding), above 2000 + 4 x sqrt(2000) -> 2179; the buffer 2000 x
    # S=2 x 1.1 = 4400, a multiple of 16. Small ones take the spread margin:
    # 7 + 4 x sqrt(7) -> 18, above 7 x 1.1 -> 8.
    assert limits["ta"] == embedding.StackLimits(
        max_ids_per_partition=2200,
        max_unique_ids_per_partition=18,
        suggested_coo_buffer_size_per_device=4400,
    )
    assert limits["tb"] == embedding.StackLimits(
        max_ids_per_partition=1,
        max_unique_ids_per_partition=1,
        suggested_coo_buffer_size_per_device=16,
    )


def test_fdo_limits_cover_the_spread_of_shuffled_batches():
    """A table of 15 values, skewed as a census column: limits from 10 batches
    in file order must hold for 20 epochs of shuffled batches; a fixed 1.1
    headroom does not (16 ids seen, 18 allowed, 19 drawn)."""
    rng = np.random.default_rng(0)
    weights = np.array([30, 15, 10, 8, 7, 6, 5, 4, 4, 3, 3, 2, 1, 1, 1]) / 100
    values = rng.choice(15, size=5120, p=weights / weights.sum())

    def specs(limit):
        table = embedding.TableSpec(
            name="occupation",
            vocabulary_size=15,
            embedding_dim=8,
            initializer=embedding.initializers.Constant(0.0),
            optimizer=embedding.SGDOptimizerSpec(),
            combiner="sum",
            max_ids_per_partition=limit,
            max_unique_ids_per_partition=limit,
        )
        shape = dict(input_shape=[512, 1], output_shape=[512, 8])
        return {"f": embedding.FeatureSpec(name="f", table_spec=table, **shape)}

    def most_ids(order):
        most = 0
        for batch in order.reshape(-1, 512):
            _, batch_stats = embedding.preprocess_sparse_dense_matmul_input(
                {"f": values[batch].reshape(-1, 1)}, None, specs(512), 8, 8, num_sc_per_device=2
            )
            most = max(most, int(batch_stats.max_ids_per_partition["occupation"].max()))
        return most

    seen = most_ids(np.arange(values.size))
    drawn = max(
        most_ids(np.random.default_rng(epoch).permutation(values.size)) for epoch in range(20)
    )
    stack = embedding.StackFdoStats(
        max_ids_per_partition=np.full(LOCAL * N, seen),
        max_unique_ids_per_partition=np.full(LOCAL * N, 1),
        required_buffer_size_per_sc=np.full(LOCAL * SLOTS, 8 * seen),
    )
    stats = embedding.FdoStats(
        config_hash=HASH, geometry=GEOMETRY, batches=10, stacks={"ta": stack}
    )
    assert math.ceil(seen * 1.1) < drawn
    assert embedding.fdo_limits(stats, headroom=1.1)["ta"].max_ids_per_partition >= drawn


@pytest.mark.parametrize("headroom", [0.9, float("inf"), float("nan")])
def test_fdo_limits_reject_bad_headroom(headroom):
    with pytest.raises(ValueError, match="headroom must be a finite number >= 1"):
        embedding.fdo_limits(_stats(), headroom=headroom)


def test_apply_fdo_returns_new_specs_for_every_feature_of_a_stack():
    specs = _specs()
    applied = embedding.apply_fdo(specs, _stats(10), headroom=1.5)
    stacks = embedding.get_stacked_table_specs(applied)
    assert sorted(stacks) == sorted(STACKS)
    for stack in stacks.values():
        # 10 + 4 x sqrt(10) -> 23 over 10 x 1.5; 5 + 4 x sqrt(5) -> 14 over 8.
        assert (stack.max_ids_per_partition, stack.max_unique_ids_per_partition) == (23, 14)
        assert stack.suggested_coo_buffer_size_per_device == 240  # 80 x S=2 x 1.5
    for name in ("b", "c"):
        assert applied[name].table_spec.stacked_table_spec is stacks["tb"]
    # The inputs are not modified (frozen specs, new objects).
    assert specs["d"].table_spec.stacked_table_spec.max_ids_per_partition == 512


def test_apply_fdo_rejects_stats_of_other_tables():
    stats = dataclasses.replace(_stats(), stacks={"ta": _stack_stats(3)})
    with pytest.raises(ValueError, match=r"stats are for stacked tables \['ta'\], the specs have"):
        embedding.apply_fdo(_specs(), stats)
    with pytest.raises(ValueError, match=r"Limits for unknown stacked tables \['zz'\]"):
        embedding.set_stack_limits(
            _specs(),
            {"zz": embedding.StackLimits(max_ids_per_partition=1, max_unique_ids_per_partition=1)},
            global_device_count=DEVICES,
            num_sc_per_device=SLOTS,
        )


def test_applied_limits_make_the_same_data_drop_nothing(tmp_path):
    specs = _specs()
    batches = _host_batches(seed=5, batches=6)
    clients = [
        embedding.FdoClient(tmp_path, config_hash=HASH, geometry=GEOMETRY, process_index=p)
        for p in range(PROCESSES)
    ]
    for hosts in batches:
        for client, features in zip(clients, hosts):
            client.record(_preprocess(features, specs))
    for client in clients:
        client.publish()
    stats = clients[1].load()
    tight = embedding.apply_fdo(specs, stats, headroom=1.0, spread_margin=0.0)
    for hosts in batches:
        for features in hosts:
            result = _preprocess(features, tight, allow_id_dropping=False)
            assert not any(result.id_drop_counters.values())
    # One less than the observed maximum is too little: the limits are tight.
    stack = embedding.get_stacked_table_specs(tight)["ta"]
    tighter = embedding.set_stack_limits(
        tight,
        {
            "ta": embedding.StackLimits(
                max_ids_per_partition=stack.max_ids_per_partition - 1,
                max_unique_ids_per_partition=stack.max_unique_ids_per_partition,
                suggested_coo_buffer_size_per_device=stack.suggested_coo_buffer_size_per_device,
            )
        },
        global_device_count=DEVICES,
        num_sc_per_device=SLOTS,
    )
    with pytest.raises(embedding.LimitBreachError, match="ta"):
        for hosts in batches:
            for features in hosts:
                _preprocess(features, tighter, allow_id_dropping=False)


_LAYOUT = embedding.FdoLayout(
    entries={"tables.t.vocabulary_size": 100, "tables.t.stack": "t", "features.f.shape": [8, 1]}
)


def test_stats_keep_their_layout_through_the_file(tmp_path):
    stats = dataclasses.replace(_stats(), layout=_LAYOUT.entries)
    embedding.write_fdo_stats(stats, tmp_path, source="offline")
    loaded = embedding.load_fdo_stats(
        tmp_path, expected_config_hash=_LAYOUT, expected_geometry=GEOMETRY
    )
    assert loaded.layout == _LAYOUT.entries


@pytest.mark.parametrize(
    "layout, message",
    [
        (_LAYOUT.entries, r"tables.t.vocabulary_size: 100 in the stats, 120 now\)"),
        ({}, "the stats hold no layout"),
    ],
    ids=["with its layout", "without a layout"],
)
def test_stats_of_another_layout_name_what_changed(tmp_path, layout, message):
    stats = dataclasses.replace(_stats(), layout=layout)
    embedding.write_fdo_stats(stats, tmp_path, source="offline")
    grown = embedding.FdoLayout(entries={**_LAYOUT.entries, "tables.t.vocabulary_size": 120})
    with pytest.raises(embedding.FdoStatsError, match=message):
        embedding.load_fdo_stats(tmp_path, expected_config_hash=grown, expected_geometry=GEOMETRY)


def test_a_layout_entry_of_another_type_is_refused():
    document = _document(_stats())
    document["layout"] = {"tables.t.vocabulary_size": 1.5}
    with pytest.raises(embedding.FdoStatsError, match=r"layout\['tables.t.vocabulary_size'\]"):
        embedding.FdoStats.from_json(json.dumps(document))


def test_a_client_with_a_layout_merges_stats_of_that_layout_from_other_configs(tmp_path):
    offline = dataclasses.replace(_stats(7), config_hash="cd" * 32, layout=_LAYOUT.entries)
    embedding.write_fdo_stats(offline, tmp_path, source="offline")
    client = embedding.FdoClient(tmp_path, config_hash=HASH, geometry=GEOMETRY, layout=_LAYOUT)
    for features in _host_batches(seed=1, batches=2):
        client.record(_preprocess(features[0], _specs()))
    online = client.stats()
    assert online.layout == _LAYOUT.entries
    client.publish()
    merged = client.load()
    for stack in STACKS:
        expected = np.maximum(
            offline.stacks[stack].max_ids_per_partition, online.stacks[stack].max_ids_per_partition
        )
        np.testing.assert_array_equal(merged.stacks[stack].max_ids_per_partition, expected)
    grown = embedding.FdoLayout(entries={**_LAYOUT.entries, "tables.t.stack": "s"})
    with pytest.raises(embedding.FdoStatsError, match='tables.t.stack: "t" in the stats, "s" now'):
        embedding.FdoClient(tmp_path, config_hash=HASH, geometry=GEOMETRY, layout=grown).load()
