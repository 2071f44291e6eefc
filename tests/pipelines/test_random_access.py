"""Tests of the batch-wise shuffle order (pipelines/_shuffle.py) and ArrayRecord reader
(pipelines/_array_record.py), against Grain's own per-record implementations."""

import os
import pickle

import grain
import numpy as np
import pytest
from grain._src.python.experimental.index_shuffle.python import index_shuffle_module

from pipelines._array_record import ArrayRecordReader
from pipelines._records import RecordFileWriter
from pipelines._shuffle import grain_epoch_order, grain_epoch_positions, shuffled_indices


@pytest.mark.parametrize("num_records", [1, 100, 257, 16_385, 50_000, 65_537, 2**20 + 3])
@pytest.mark.parametrize("seed", [0, 1, 12_345, 2**32 - 1])
def test_shuffled_indices_equal_grains_index_shuffle(num_records, seed):
    rng = np.random.default_rng(seed % 1000)
    indices = rng.integers(0, num_records, 300)
    expected = [
        index_shuffle_module.index_shuffle(int(i), max_index=num_records - 1, seed=seed, rounds=4)
        for i in indices
    ]
    np.testing.assert_array_equal(shuffled_indices(indices, num_records - 1, seed), expected)


# Small datasets walk long cycles (the cipher's smallest block is 2**16).
@pytest.mark.parametrize(
    "num_records, seed", [(2, 1), (100, 7), (5_000, 2**32 - 1), (20_000, 0), (70_001, 3)]
)
def test_epoch_order_is_grains_global_shuffle_in_every_epoch(num_records, seed):
    order = grain.MapDataset.range(num_records).shuffle(seed=seed)
    positions = np.arange(min(num_records, 300))
    for epoch in range(3):
        expected = [order[epoch * num_records + int(p)] for p in positions]
        np.testing.assert_array_equal(
            grain_epoch_order(num_records, seed, epoch, positions), expected
        )


@pytest.mark.parametrize("num_records, seed", [(1, 0), (2, 1), (1000, 5), (70_001, 2**32 - 1)])
def test_epoch_positions_invert_the_epoch_order(num_records, seed):
    records = np.arange(num_records)
    for epoch in range(2):
        positions = grain_epoch_positions(num_records, seed, epoch, records)
        np.testing.assert_array_equal(
            grain_epoch_order(num_records, seed, epoch, positions), records
        )


@pytest.mark.parametrize("num_records", [1000, 40_000])
def test_each_epoch_order_is_a_permutation(num_records):
    order = grain_epoch_order(num_records, 3, 0, np.arange(num_records))
    assert sorted(order.tolist()) == list(range(num_records))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Three ArrayRecord files of 5, 1 and 7 records `b"file f record r"`."""
    directory = tmp_path_factory.mktemp("records")
    paths, records = [], []
    for f, count in enumerate((5, 1, 7)):
        path = str(directory / f"part-{f}.array_record")
        with RecordFileWriter(path) as writer:
            for r in range(count):
                record = f"file {f} record {r}".encode()
                writer.write(record)
                records.append(record)
        paths.append(path)
    return paths, records


@pytest.mark.parametrize(
    "indices",
    [[], [0], [12, 0, 5, 5, 6, 11, 4], list(range(13)), list(reversed(range(13)))],
)
def test_reader_returns_the_records_in_the_order_asked(files, indices):
    paths, records = files
    reader = ArrayRecordReader(paths)
    assert list(reader.read(np.asarray(indices, np.int64))) == [records[i] for i in indices]
    source = grain.sources.ArrayRecordDataSource(paths)
    assert list(reader.read(indices)) == [source[i] for i in indices]
    assert reader.files.counts == (5, 1, 7)


def test_reader_survives_pickling(files):
    paths, records = files
    copy = pickle.loads(pickle.dumps(ArrayRecordReader(paths)))
    assert list(copy.read([7, 5, 0])) == [records[7], records[5], records[0]]


@pytest.mark.parametrize("index", [-1, 13])
def test_an_index_outside_the_dataset_is_named(files, index):
    with pytest.raises(IndexError, match=f"Record {index} is outside the dataset of 13 records"):
        ArrayRecordReader(files[0]).read([0, index])


def test_a_file_of_another_format_is_refused(tmp_path):
    path = str(tmp_path / "part-0.tfrecord")
    with pytest.raises(ValueError, match=f"{path} is not one. Read it with make_tfdata_iterator"):
        ArrayRecordReader([path])


def test_a_file_that_is_not_an_array_record_file_is_named(tmp_path):
    path = tmp_path / "part-0.array_record"
    path.write_bytes(os.urandom(256))
    with pytest.raises(ValueError, match=str(path)):
        ArrayRecordReader([str(path)])
