"""The FDO job over the batches training draws: shuffled, over epochs, bad records filled in.

The reference is the training input itself: the Grain iterator's host
batches, whose rows are told apart by a dense value that numbers the record.
"""

import dataclasses
import json
import os

import apache_beam as beam
import fdo_cases
import numpy as np
import pytest
from apache_beam.testing.util import assert_that, equal_to

import beam_jobs
import embedding
import pipelines
from beam_jobs._batches import SparseRows
from beam_jobs._training_batches import join_group

EPOCHS = 3
SEED = 11
# Parse errors: training skips them and fills their rows.
BAD = ("not an example", "missing feature", "bad label")


def _record(row: int) -> bytes:
    return fdo_cases.example(row, dense=fdo_cases._floats(float(row), -1.0))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """`(files, {row: record})`: 150 records in 2 ArrayRecord files, 5 of them bad."""
    directory = tmp_path_factory.mktemp("training_batches")
    by_row, files, row = {}, [], 0
    for index, count in enumerate((61, 89)):
        records = []
        for position in range(count):
            if position % 29 == 7:
                records.append(fdo_cases.BAD_RECORDS[BAD[(row + position) % 3]][0])
                continue
            by_row[row] = _record(row)
            records.append(by_row[row])
            row += 1
        path = os.path.join(directory, f"part-{index}.array_record")
        files.append(fdo_cases.write_records(path, records))
    return files, by_row


def _training_batches(files, by_row, processes: int, seed) -> list[list[bytes]]:
    """The records of every global batch the Grain iterators of all hosts yield, in row order."""
    specs = fdo_cases.feature_specs()
    hosts = []
    for host in range(processes):
        batching = pipelines.BatchingConfig(
            global_batch_size=fdo_cases.BATCH,
            process_index=host,
            process_count=processes,
            num_epochs=EPOCHS,
            shuffle_seed=seed,
        )
        preprocess = pipelines.PreprocessConfig(
            feature_specs=specs,
            layout=fdo_cases.LAYOUT,
            local_device_count=fdo_cases.DEVICES // processes,
            global_device_count=fdo_cases.DEVICES,
            num_sc_per_device=fdo_cases.PARTITIONS_PER_DEVICE,
            allow_id_dropping=True,
            on_bad_record="skip",
        )
        with pipelines.make_grain_iterator(
            files, batching=batching, preprocess=preprocess, log_interval_s=None
        ) as batches:
            hosts.append([[by_row[int(r)] for r in batch.dense[:, 0]] for batch in batches])
    return [sum(shares, []) for shares in zip(*hosts, strict=True)]


def _stats_of(batch: int, records: list[bytes], geometry) -> str:
    stacks = fdo_cases._batch_stats(records, fdo_cases.feature_specs(), geometry)
    return _as_json(
        batch, {s: {f: v.max(axis=0) for f, v in fs.items()} for s, fs in stacks.items()}
    )


def _as_json(batch: int, stacks) -> str:
    plain = {s: {f: np.asarray(v).tolist() for f, v in fs.items()} for s, fs in stacks.items()}
    return json.dumps([batch, plain], sort_keys=True)


# 40 records per range: one batch of 32 per group; 100: groups of 3 batches.
@pytest.mark.parametrize(
    "processes, seed, records_per_range",
    [(1, SEED, 40), (2, SEED, 40), (2, None, 40), (2, SEED, 100)],
)
def test_job_batches_are_the_batches_training_draws(dataset, processes, seed, records_per_range):
    files, by_row = dataset
    batches = _training_batches(files, by_row, processes, seed)
    assert len(batches) == EPOCHS * (150 // fdo_cases.BATCH)
    geometry = fdo_cases.geometry(processes)
    expected = [_stats_of(b, records, geometry) for b, records in enumerate(batches)]
    config = dataclasses.replace(
        fdo_cases.job_config(processes=processes, records_per_range=records_per_range),
        training_order=beam_jobs.TrainingOrder(shuffle_seed=seed, epochs=EPOCHS),
    )
    with beam_jobs.make_pipeline() as p:
        read = p | beam_jobs.ReadGlobalBatches(files, config)
        per_batch = (
            read["batches"]
            | beam_jobs.ComputeBatchStats(config)
            | beam.Map(lambda stats: _as_json(stats.batch, stats.stacks))
        )
        assert_that(per_batch, equal_to(expected), label="per-batch stats")
        order = embedding.FdoBatchOrder(records=150, shuffle_seed=seed, epochs=EPOCHS)
        assert_that(read["batch_order"], equal_to([order]), label="batch order")


def test_stats_file_says_which_batches_it_covers(dataset, tmp_path):
    files, _ = dataset
    order = beam_jobs.TrainingOrder(shuffle_seed=SEED, epochs=EPOCHS)
    config = dataclasses.replace(fdo_cases.job_config(), training_order=order)
    result = beam_jobs.run_fdo_job(config, files, str(tmp_path))
    assert result.stats.batches == EPOCHS * (150 // fdo_cases.BATCH)
    assert result.counters["bad_records"] == 150 - len(dataset[1]) == 5
    # Each epoch drops the records at its last 150 mod 32 positions; 3 are bad.
    assert result.counters["tail_records"] <= EPOCHS * (150 % fdo_cases.BATCH)
    loaded = embedding.load_fdo_stats(
        str(tmp_path), expected_config_hash=None, expected_geometry=fdo_cases.geometry()
    )
    assert loaded.batch_order == embedding.FdoBatchOrder(
        records=150, shuffle_seed=SEED, epochs=EPOCHS
    )
    assert loaded.batch_order.covers(dataclasses.replace(loaded.batch_order, epochs=1))
    assert not loaded.batch_order.covers(dataclasses.replace(loaded.batch_order, shuffle_seed=1))


def _part(batches: list[int], keys: list[int], values: list[int]):
    """A group part of one-id rows: `(batches, keys, rows)`."""
    ids = embedding.RaggedIds(np.array(values, np.int64), np.arange(len(values) + 1))
    rows = SparseRows(ids={"f": ids}, weights={})
    return np.array(batches), np.array(keys), rows


def test_join_group_orders_each_batch_by_key_from_parts_in_any_order():
    parts = [
        _part([4, 4, 5], [3, 0, 1], [43, 40, 51]),
        _part([5, 4, 5], [2, 1, 0], [52, 41, 50]),
        _part([4, 5], [2, 3], [42, 53]),
    ]
    joined = list(join_group(1, reversed(parts), batch_size=4))
    assert [batch for batch, _ in joined] == [4, 5]
    assert joined[0][1].ids["f"].values.tolist() == [40, 41, 42, 43]
    assert joined[1][1].ids["f"].values.tolist() == [50, 51, 52, 53]


def test_join_group_rejects_a_batch_of_the_wrong_size():
    parts = [_part([4, 4, 5], [0, 1, 0], [40, 41, 50])]
    with pytest.raises(ValueError, match="Batch 5: its records make 1 rows, not 2"):
        list(join_group(2, parts, batch_size=2))
