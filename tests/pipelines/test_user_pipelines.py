"""A Grain or tf.data pipeline of one's own with our parsing and preprocessing
(pipelines/_grain_transforms.py, _tfdata_map.py) gives `make_grain_iterator`'s
batches on the same records."""

import grain
import numpy as np
import pipeline_cases as cases
import pytest
import tensorflow as tf

import pipelines
from pipelines import (
    BatchingConfig,
    LayOutBatch,
    ParseRecords,
    TFDataPreprocess,
    make_grain_iterator,
)

NUM_RECORDS = 100
BATCH = 16
PER_EPOCH = NUM_RECORDS // BATCH


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return cases.write_dataset(str(tmp_path_factory.mktemp("user")), NUM_RECORDS)


def _one_call(files, batching, preprocess):
    with make_grain_iterator(files["arrayrecord"], batching=batching, preprocess=preprocess) as it:
        return [cases.flat(batch) for batch in it]


def _user_records(files, batching: BatchingConfig, seed: int | None) -> grain.MapDataset:
    """This host's record chunks, one per global batch, as a user would write them."""
    records = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(files["arrayrecord"]))
    if seed is not None:
        records = records.shuffle(seed=seed)
    host = batching.process_index
    return (
        records[: PER_EPOCH * BATCH]  # each epoch's full global batches
        .repeat(batching.num_epochs)
        .batch(batching.host_batch_size, batch_fn=list)[host :: batching.process_count]  # fmt: skip
    )


@pytest.mark.parametrize(
    "process_index, process_count, seed", [(0, 1, None), (1, 2, None), (0, 1, 7), (1, 2, 5)]
)
def test_a_grain_chain_of_the_transforms_gives_the_iterators_batches(
    files, process_index, process_count, seed
):
    batching = BatchingConfig(
        global_batch_size=BATCH,
        process_index=process_index,
        process_count=process_count,
        num_epochs=2,
        shuffle_seed=seed,
    )
    preprocess = cases.preprocess_config(BATCH, global_devices=2 * process_count)
    lay_out = LayOutBatch(preprocess)
    dataset = (
        _user_records(files, batching, seed)
        .map(ParseRecords(preprocess.layout))
        .map_with_index(lay_out)
        .to_iter_dataset()
    )
    batches = [cases.flat(batch) for batch in dataset]
    lay_out.close()
    assert len(batches) == 2 * PER_EPOCH
    cases.assert_batches_equal(batches, _one_call(files, batching, preprocess))


def test_the_chain_in_grain_workers_agrees_with_the_iterator(files):
    batching = BatchingConfig(global_batch_size=BATCH)
    preprocess = cases.preprocess_config(BATCH, limit=7, enable_minibatching=True)
    dataset = (
        _user_records(files, batching, None)
        .map(ParseRecords(preprocess.layout))
        .map_with_index(LayOutBatch(preprocess))
        .to_iter_dataset()
        .mp_prefetch(
            grain.MultiprocessingOptions(num_workers=2),
            worker_init_fn=pipelines.init_grain_worker,
        )
    )
    batches = list(dataset)
    expected = _one_call(files, batching, preprocess)
    cases.assert_batches_equal([cases.flat(batch) for batch in batches], expected)
    assert max(batch.report.num_minibatches for batch in batches) > 1
    assert all(batch.report.records == BATCH for batch in batches)


def test_grains_default_batch_of_bytes_is_refused_not_misread(files):
    preprocess = cases.preprocess_config(BATCH)
    records = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(files["arrayrecord"]))
    fixed_width = records.batch(BATCH)[0]
    assert fixed_width.dtype.kind == "S"
    with pytest.raises(TypeError, match="batch_fn=list"):
        ParseRecords(preprocess.layout).map(fixed_width)


def test_a_layout_on_the_wrong_worker_is_refused(files, monkeypatch):
    from pipelines import _grain

    preprocess = cases.preprocess_config(BATCH)
    chunk = _user_records(files, BatchingConfig(global_batch_size=BATCH), None)[1]
    parsed = ParseRecords(preprocess.layout).map(chunk)
    monkeypatch.setattr(_grain, "_worker", (0, 2))
    with pytest.raises(RuntimeError, match="Batch 1 reached worker 0 of 2"):
        LayOutBatch(preprocess).map_with_index(1, parsed)


@pytest.mark.parametrize("process_index, process_count", [(0, 1), (1, 2)])
def test_a_tfdata_chain_of_the_map_gives_the_iterators_batches(files, process_index, process_count):
    batching = BatchingConfig(
        global_batch_size=BATCH, process_index=process_index, process_count=process_count
    )
    preprocess = cases.preprocess_config(
        BATCH, global_devices=2 * process_count, limit=2, allow_id_dropping=True
    )
    preprocess_map = TFDataPreprocess(preprocess)
    dataset = (
        tf.data.TFRecordDataset(files["tfrecord"])
        .batch(batching.host_batch_size, drop_remainder=True)
        .shard(process_count, process_index)
        .enumerate()
        .map(preprocess_map)
    )
    assert dataset.element_spec[1].shape.as_list() == [2, None]
    batches = [preprocess_map.host_batch(element) for element in dataset.as_numpy_iterator()]
    preprocess_map.close()
    with make_grain_iterator(
        files["arrayrecord"], batching=batching, preprocess=preprocess
    ) as iterator:
        expected = list(iterator)
    cases.assert_batches_equal(
        [cases.flat(batch) for batch in batches], [cases.flat(batch) for batch in expected]
    )
    for got, want in zip(batches, expected, strict=True):
        assert got.report.dropped_ids == want.report.dropped_ids
        assert got.report.records == want.report.records
    assert sum(sum(batch.report.dropped_ids.values()) for batch in batches) > 0


def test_the_tfdata_map_refuses_a_short_batch(files):
    preprocess_map = TFDataPreprocess(cases.preprocess_config(BATCH))
    records = list(pipelines.read_records(files["tfrecord"]))[: BATCH - 1]
    with pytest.raises(ValueError, match="holds 15 records; this host lays out 16"):
        preprocess_map.numpy_map(np.int64(0), np.array(records, dtype=object))
