"""Tests of the tf.data input path (pipelines/_tfdata.py) against the Grain path."""

import grain
import pipeline_cases as cases
import pytest

import pipelines
from pipelines import BatchingConfig, make_grain_iterator, make_tfdata_iterator

BATCH = 16


def _batches(make, files, batching, preprocess):
    with make(files, batching=batching, preprocess=preprocess) as iterator:
        return [cases.flat(batch) for batch in iterator], iterator.stats()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return cases.write_dataset(str(tmp_path_factory.mktemp("tfdata")), 90, num_shards=3)


@pytest.mark.parametrize("shuffle_seed", [None, 7])
@pytest.mark.parametrize("process_index, process_count", [(0, 1), (1, 2)])
def test_tfdata_and_grain_give_identical_batches(
    dataset, process_index, process_count, shuffle_seed
):
    preprocess = cases.preprocess_config(BATCH, local_devices=2, global_devices=2 * process_count)
    batching = BatchingConfig(
        global_batch_size=BATCH,
        process_index=process_index,
        process_count=process_count,
        num_epochs=2,
        shuffle_seed=shuffle_seed,
    )
    from_tfdata, stats = _batches(make_tfdata_iterator, dataset["tfrecord"], batching, preprocess)
    from_grain, _ = _batches(make_grain_iterator, dataset["arrayrecord"], batching, preprocess)
    assert len(from_tfdata) == 2 * (90 // BATCH)
    cases.assert_batches_equal(from_tfdata, from_grain)
    assert stats["batches"] == len(from_tfdata)
    assert stats["records"] == len(from_tfdata) * BATCH // process_count


@pytest.mark.parametrize("shuffle_seed", [None, 5])
def test_skipped_bad_records_are_filled_alike_on_both_paths(tmp_path, shuffle_seed):
    good = list(pipelines.read_records(cases.write_dataset(str(tmp_path / "src"), 40)["tfrecord"]))
    records = list(good)
    # Batch 1 of 2 (records 16..31) loses two records; its fill-ins wrap to
    # the epoch's first batch.
    records[20] = b"\x00garbage"
    records[31] = cases.serialize_without(good[31], "a")
    files = cases.write_records(str(tmp_path), records)
    preprocess = cases.preprocess_config(BATCH, on_bad_record="skip")
    batching = BatchingConfig(global_batch_size=BATCH, shuffle_seed=shuffle_seed)
    from_tfdata, stats = _batches(make_tfdata_iterator, files["tfrecord"], batching, preprocess)
    from_grain, _ = _batches(make_grain_iterator, files["arrayrecord"], batching, preprocess)
    cases.assert_batches_equal(from_tfdata, from_grain)
    assert stats["bad_records"] == 2
    if shuffle_seed is None:
        rows = [i for i in range(16, 32) if i not in (20, 31)] + [0, 1]
        expected, _ = cases.reference_batch([records[i] for i in rows], preprocess, 1)
        cases.assert_batches_equal(from_tfdata[1:], [expected])


@pytest.mark.parametrize("shuffle_seed", [None, 3])
def test_a_restored_tfdata_iterator_continues_with_the_next_batch(dataset, shuffle_seed):
    preprocess = cases.preprocess_config(BATCH)
    batching = BatchingConfig(global_batch_size=BATCH, num_epochs=2, shuffle_seed=shuffle_seed)
    uninterrupted, _ = _batches(make_tfdata_iterator, dataset["tfrecord"], batching, preprocess)
    with make_tfdata_iterator(dataset["tfrecord"], batching=batching, preprocess=preprocess) as it:
        for _ in range(7):
            next(it)
        state = it.get_state()
    with make_tfdata_iterator(dataset["tfrecord"], batching=batching, preprocess=preprocess) as it:
        it.set_state(state)
        assert it.next_batch == 7
        cases.assert_batches_equal([cases.flat(b) for b in it], uninterrupted[7:])


def test_a_state_of_another_pipeline_is_refused(dataset):
    preprocess = cases.preprocess_config(BATCH)
    with make_tfdata_iterator(
        dataset["tfrecord"], batching=BatchingConfig(global_batch_size=BATCH), preprocess=preprocess
    ) as it:
        state = it.get_state()
    other = BatchingConfig(global_batch_size=BATCH, num_epochs=3)
    with make_tfdata_iterator(dataset["tfrecord"], batching=other, preprocess=preprocess) as it:
        with pytest.raises(ValueError, match=r"'num_epochs': \(1, 3\)"):
            it.set_state(state)
        with pytest.raises(ValueError, match="Not an input iterator state"):
            it.set_state(b"{}")


def test_a_seed_reads_in_grains_own_shuffled_order(dataset):
    preprocess = cases.preprocess_config(BATCH)
    batching = BatchingConfig(global_batch_size=BATCH, num_epochs=2, shuffle_seed=7)
    from_tfdata, _ = _batches(make_tfdata_iterator, dataset["tfrecord"], batching, preprocess)
    records = list(pipelines.read_records(dataset["tfrecord"]))
    order = grain.MapDataset.range(len(records)).shuffle(seed=7)
    per_epoch = len(records) // BATCH
    for b, batch in enumerate(from_tfdata):
        epoch, first = divmod(b, per_epoch)
        rows = [order[epoch * len(records) + first * BATCH + i] for i in range(BATCH)]
        expected, _ = cases.reference_batch([records[r] for r in rows], preprocess, b)
        cases.assert_batches_equal([batch], [expected])
    assert from_tfdata[0]["labels"].tolist() != from_tfdata[per_epoch]["labels"].tolist()


def test_a_truncated_tfrecord_file_is_named_when_indexed(tmp_path, dataset):
    path = tmp_path / "cut.tfrecord"
    path.write_bytes(open(dataset["tfrecord"][0], "rb").read()[:-5])
    batching = BatchingConfig(global_batch_size=BATCH, shuffle_seed=1)
    with pytest.raises(ValueError, match=f"{path}: corrupt or truncated TFRecord file"):
        make_tfdata_iterator(
            str(path), batching=batching, preprocess=cases.preprocess_config(BATCH)
        )


def test_the_tfdata_path_refuses_array_record_files(dataset):
    preprocess = cases.preprocess_config(BATCH)
    with pytest.raises(ValueError, match="make_grain_iterator"):
        make_tfdata_iterator(
            dataset["arrayrecord"],
            batching=BatchingConfig(global_batch_size=BATCH),
            preprocess=preprocess,
        )
