"""Tests of the Grain input path (pipelines/_grain.py, _batching.py, _preprocess_stage.py).

Expected batches are computed independently: the records at the batch's
positions, read in file order (or in Grain's documented shuffle order), parsed
and preprocessed directly.
"""

import logging
import threading

import grain
import jax
import numpy as np
import pipeline_cases as cases
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import pipelines
from pipelines import BatchingConfig, make_grain_iterator
from pipelines._batching import BatchPlan

NUM_RECORDS = 100
BATCH = 16


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    directory = tmp_path_factory.mktemp("grain")
    files = cases.write_dataset(str(directory), NUM_RECORDS)
    records = list(pipelines.read_records(files["tfrecord"]))
    return files["arrayrecord"], records


def _run(files, batching, preprocess, **kwargs):
    with make_grain_iterator(files, batching=batching, preprocess=preprocess, **kwargs) as it:
        batches = [cases.flat(batch) for batch in it]
        return batches, it.stats()


@pytest.mark.parametrize("process_index, process_count", [(0, 1), (0, 2), (1, 2)])
def test_unshuffled_batches_are_the_host_rows_of_consecutive_global_batches(
    dataset, process_index, process_count
):
    files, records = dataset
    preprocess = cases.preprocess_config(BATCH, local_devices=2, global_devices=2 * process_count)
    batching = BatchingConfig(
        global_batch_size=BATCH, process_index=process_index, process_count=process_count
    )
    batches, stats = _run(files, batching, preprocess)
    rows = BATCH // process_count
    expected = []
    for number in range(NUM_RECORDS // BATCH):
        start = number * BATCH + process_index * rows
        expected.append(cases.reference_batch(records[start : start + rows], preprocess, number)[0])
    cases.assert_batches_equal(batches, expected)
    assert stats["batches"] == NUM_RECORDS // BATCH
    assert stats["records"] == (NUM_RECORDS // BATCH) * rows


def test_shuffle_gives_a_new_permutation_every_epoch_and_drops_each_epochs_tail(dataset):
    files, records = dataset
    preprocess = cases.preprocess_config(BATCH)
    batching = BatchingConfig(global_batch_size=BATCH, num_epochs=2, shuffle_seed=7)
    batches, _ = _run(files, batching, preprocess)
    per_epoch = NUM_RECORDS // BATCH
    assert len(batches) == 2 * per_epoch
    order = grain.MapDataset.range(NUM_RECORDS).shuffle(seed=7)
    for epoch in range(2):
        positions = range(epoch * NUM_RECORDS, epoch * NUM_RECORDS + per_epoch * BATCH)
        indices = [order[position] for position in positions]
        assert len(set(indices)) == per_epoch * BATCH
        for number in range(per_epoch):
            chosen = [records[i] for i in indices[number * BATCH : (number + 1) * BATCH]]
            expected, _ = cases.reference_batch(chosen, preprocess, epoch * per_epoch + number)
            cases.assert_batches_equal([batches[epoch * per_epoch + number]], [expected])
    first = np.concatenate([b["dense"] for b in batches[:per_epoch]])
    second = np.concatenate([b["dense"] for b in batches[per_epoch:]])
    assert not np.array_equal(first, second)


def test_one_seed_gives_the_same_batches_in_every_run(dataset):
    # Equality with two worker processes is checked in test_resume.py, which
    # compares a run with workers to this in-process one.
    files, _ = dataset
    preprocess = cases.preprocess_config(BATCH)
    batching = BatchingConfig(global_batch_size=BATCH, shuffle_seed=3)
    first, _ = _run(files, batching, preprocess)
    again, _ = _run(files, batching, preprocess)
    cases.assert_batches_equal(again, first)
    other_seed, _ = _run(files, BatchingConfig(global_batch_size=BATCH, shuffle_seed=4), preprocess)
    assert not np.array_equal(other_seed[0]["dense"], first[0]["dense"])


@pytest.fixture(scope="module")
def bad_dataset(tmp_path_factory):
    """48 records; records 3, 17 and 18 are bad (3 batches of 16)."""
    directory = tmp_path_factory.mktemp("bad")
    good = list(pipelines.read_records(cases.write_dataset(str(directory / "src"), 48)["tfrecord"]))
    records = list(good)
    records[3] = b"not an example"
    records[17] = cases.serialize_without(good[17], "label")
    records[18] = b""
    return cases.write_records(str(directory), records), records


def test_bad_records_are_skipped_counted_and_replaced_by_the_next_good_ones(bad_dataset, caplog):
    files, records = bad_dataset
    preprocess = cases.preprocess_config(BATCH, on_bad_record="skip")
    with caplog.at_level(logging.WARNING, logger="pipelines._preprocess_stage"):
        batches, stats = _run(
            files["arrayrecord"], BatchingConfig(global_batch_size=BATCH), preprocess
        )
    # Batch 0 loses record 3 and takes 16, the first good record after it;
    # batch 1 loses 17 and 18 and takes 32 and 33; fill-ins stay in their own batch.
    rows = [
        [i for i in range(17) if i != 3],
        [i for i in range(16, 34) if i not in (17, 18)],
        list(range(32, 48)),
    ]
    expected = [
        cases.reference_batch([records[i] for i in chosen], preprocess, number)[0]
        for number, chosen in enumerate(rows)
    ]
    cases.assert_batches_equal(batches, expected)
    assert stats["bad_records"] == 3
    assert stats["records"] == 48 + 1 + 2
    logged = " ".join(record.getMessage() for record in caplog.records)
    assert "record 3 of" in logged and "not a serialized tf.train.Example" in logged
    assert "missing feature 'label'" in logged


def test_a_bad_record_raises_naming_the_record_and_file_by_default(bad_dataset):
    files, _ = bad_dataset
    preprocess = cases.preprocess_config(BATCH)
    with pytest.raises(pipelines.InputRecordError) as error:
        _run(files["arrayrecord"], BatchingConfig(global_batch_size=BATCH), preprocess)
    message = str(error.value)
    assert "batch 0 (host 0 of 1)" in message
    assert "record 3 of " in message and "part-00000.array_record" in message
    assert "on_bad_record='skip'" in message


def test_stats_count_dropped_and_invalid_ids_like_the_preprocessing(dataset):
    files, records = dataset
    # Table t1 holds 40 of the 64 ids feature `a` draws from: the rest are invalid.
    preprocess = cases.preprocess_config(
        BATCH, limit=2, t1_vocabulary=40, allow_id_dropping=True, invalid_id_policy="drop"
    )
    batches, stats = _run(files, BatchingConfig(global_batch_size=BATCH), preprocess)
    dropped, invalid = {"t1": 0, "t2": 0}, {"t1": 0, "t2": 0}
    for number in range(len(batches)):
        chosen = records[number * BATCH : (number + 1) * BATCH]
        _, reference = cases.reference_batch(chosen, preprocess, number)
        for table in dropped:
            dropped[table] += int(reference.id_drop_counters[table])
            invalid[table] += int(reference.invalid_id_counters[table])
    assert stats["dropped_ids_per_table"] == dropped and sum(dropped.values()) > 0
    assert stats["invalid_ids_per_table"] == invalid and invalid["t1"] > 0
    assert stats["dropped_ids"] == sum(dropped.values())
    assert set(stats) >= {"records_per_s", "batches_per_s", "parse_s", "preprocess_s", "read_s"}


def test_a_limit_breach_without_dropping_names_the_batch(dataset):
    files, _ = dataset
    preprocess = cases.preprocess_config(BATCH, limit=1)
    with pytest.raises(ValueError, match="max_ids_per_partition") as error:
        _run(files, BatchingConfig(global_batch_size=BATCH), preprocess)
    assert "In batch 0 (host 0 of 1)." in error.value.__notes__


def test_the_iterator_ends_after_the_full_global_batches_and_closes(dataset):
    files, _ = dataset
    preprocess = cases.preprocess_config(BATCH)
    iterator = make_grain_iterator(
        files, batching=BatchingConfig(global_batch_size=BATCH, num_epochs=2), preprocess=preprocess
    )
    with iterator:
        assert iterator.num_batches == 2 * (NUM_RECORDS // BATCH)
        numbers = [batch.batch_number for batch in iterator]
        assert numbers == list(range(iterator.num_batches))
        with pytest.raises(StopIteration):
            next(iterator)
    with pytest.raises(ValueError, match="closed"):
        next(iterator)


@pytest.mark.parametrize(
    "batch, specs_batch, process_count, message",
    [
        (32, BATCH, 1, "global batch of 16, the batching config for 32"),
        (BATCH, BATCH, 2, "process_count is 2"),
        (128, 128, 1, "holds 100 records, fewer than one global batch of 128"),
    ],
)
def test_inconsistent_settings_are_refused(dataset, batch, specs_batch, process_count, message):
    files, _ = dataset
    batching = BatchingConfig(global_batch_size=batch, process_count=process_count)
    with pytest.raises(ValueError, match=message):
        make_grain_iterator(
            files, batching=batching, preprocess=cases.preprocess_config(specs_batch)
        )


def test_tfrecord_files_are_refused_with_the_right_path_named(tmp_path):
    files = cases.write_dataset(str(tmp_path), 20)
    with pytest.raises(ValueError, match="make_tfdata_iterator"):
        make_grain_iterator(
            files["tfrecord"],
            batching=BatchingConfig(global_batch_size=BATCH),
            preprocess=cases.preprocess_config(BATCH),
        )


def test_minibatching_on_several_hosts_needs_an_agreement_group():
    with pytest.raises(ValueError, match="needs `agreement`"):
        cases.preprocess_config(BATCH, global_devices=4, enable_minibatching=True)


def test_device_batches_are_global_arrays_sharded_over_the_mesh_and_resume_exactly(dataset):
    files, _ = dataset
    mesh = jax.sharding.Mesh(jax.devices(), ("x",))
    assert mesh.size == 8
    preprocess = cases.preprocess_config(BATCH, local_devices=8, global_devices=8, partitions=1)
    batching = BatchingConfig(global_batch_size=BATCH, shuffle_seed=5)
    host_batches, _ = _run(files, batching, preprocess)

    def device_iterator():
        host = make_grain_iterator(files, batching=batching, preprocess=preprocess)
        return pipelines.DeviceIterator(host, mesh, buffer_size=2)

    with device_iterator() as batches:
        first = [next(batches) for _ in range(2)]
        state = batches.get_state()
        rest = list(batches)
        stats = batches.stats()
    cases.assert_batches_equal([cases.flat(b) for b in first + rest], host_batches)
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    for batch, expected in zip(first, host_batches):
        for leaf in jax.tree.leaves((batch.preprocessed, batch.dense, batch.labels)):
            assert isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(
                sharding, leaf.ndim
            )
        row_pointers = batch.preprocessed.lhs_row_pointers["t1"]
        per_device = expected["t1/lhs_row_pointers"].size // 8
        for shard in row_pointers.addressable_shards:
            device = shard.index[0].start // per_device
            np.testing.assert_array_equal(
                shard.data,
                expected["t1/lhs_row_pointers"][device * per_device : (device + 1) * per_device],
            )
    assert stats["device_put_s"] > 0 and stats["batches"] == len(host_batches)

    with device_iterator() as resumed:
        resumed.set_state(state)
        cases.assert_batches_equal([cases.flat(b) for b in resumed], host_batches[2:])


def test_closing_stops_a_prefetch_thread_that_waits_on_the_full_buffer(dataset, monkeypatch):
    # The thread polls the full buffer for the stop every _PUT_POLL_S; with an
    # hour between polls, a close that waited for the poll would outwait its
    # 20 s timeout and raise InputTimeoutError.
    monkeypatch.setattr(pipelines._device, "_PUT_POLL_S", 3600.0)
    files, _ = dataset
    mesh = jax.sharding.Mesh(jax.devices(), ("x",))
    preprocess = cases.preprocess_config(BATCH, local_devices=8, global_devices=8, partitions=1)
    host = make_grain_iterator(
        files, batching=BatchingConfig(global_batch_size=BATCH), preprocess=preprocess
    )
    iterator = pipelines.DeviceIterator(host, mesh, buffer_size=1, timeout_s=20.0)
    first = next(iterator)
    for _ in range(2000):  # until the thread holds a batch it cannot put (bounded: 20 s)
        if iterator._buffer.full() and iterator._thread.is_alive():
            break
        threading.Event().wait(0.01)
    assert iterator._buffer.full()
    thread = iterator._thread
    iterator.close()
    assert not thread.is_alive()
    assert first.batch_number == 0


def test_batch_plan_rows_fill_ins_and_tail_by_hand():
    config = BatchingConfig(global_batch_size=4, process_index=1, process_count=2, num_epochs=2)
    plan = BatchPlan(config=config, num_records=14)
    assert (plan.batches_per_epoch, plan.num_batches, plan.dropped_per_epoch) == (3, 6, 2)
    # Global batch 1 holds positions 4..7; host 1 takes rows 2..3 of it.
    np.testing.assert_array_equal(plan.record_indices(1), [6, 7])
    np.testing.assert_array_equal(plan.record_indices(4), [6, 7])
    following = [chunk.tolist() for chunk in plan.following_record_indices(2)]
    assert following == [[2, 3], [6, 7]]
    with pytest.raises(IndexError, match="outside"):
        plan.record_indices(6)


def test_stats_add_up_and_are_logged_every_interval(caplog):
    now = [0.0]
    stats = pipelines.PipelineStats("test input", log_interval_s=10.0, clock=lambda: now[0])
    report = pipelines.BatchReport(
        records=8,
        bad_records=1,
        read_s=0.5,
        parse_s=0.25,
        preprocess_s=1.0,
        dropped_ids={"t1": 2},
        invalid_ids={"t1": 1, "t2": 3},
        num_minibatches=2,
    )
    with caplog.at_level(logging.INFO, logger="pipelines._stats"):
        now[0] = 4.0
        stats.add_batch(report, host_wait_s=0.5)
        assert not caplog.records
        now[0] = 10.0
        stats.add_batch(report._replace(num_minibatches=1), host_wait_s=0.25)
    assert len(caplog.records) == 1
    assert "test input: 2 batches, 2 records/s" in caplog.records[0].getMessage()
    summary = stats.as_dict()
    assert summary["records"] == 16 and summary["bad_records"] == 2
    assert summary["dropped_ids_per_table"] == {"t1": 4} and summary["invalid_ids"] == 8
    assert summary["minibatched_batches"] == 1
    assert summary["preprocess_s"] == 2.0 and summary["host_wait_s"] == 0.75
    assert summary["batches_per_s"] == 0.2
