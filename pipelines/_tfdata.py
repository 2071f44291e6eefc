"""The tf.data input path: TFRecord files -> preprocessed host batches.

For users whose data is TFRecord. Unshuffled (`shuffle_seed=None`), the
files are read in file order with tf.data,

    TFRecordDataset(files)
      .take(batches_per_epoch * global_batch)   # the epoch's full global batches
      .batch(host_batch)                        # chunk c: rows of global batch c // P
      .shard(P, p)                              # host p's chunks
      .repeat(epochs)

every host reading the whole stream and keeping its chunks; a fill-in read
(rare) rescans the files up to the records it needs.

Shuffled, the order is the Grain path's (Grain's global shuffle of the seed,
a new permutation per epoch, `_shuffle.py`): the files are indexed once
(`_tfrecord_index.py`, the offset of every record), and

    Dataset.range(num_batches)
      .map(batch b -> this host's rows of global batch b, read by offset)

so training on ordered logs (a day of clicks in time order) sees them mixed
as on the Grain path, with the same records in the same batches.

Every chunk is parsed with `tf.io.parse_example` (ragged features,
`parse_examples`) and preprocessed by the same `PreprocessStage` as the
Grain path, so both paths give identical batches for the same order and
seed, bad-record fill-ins included. The state is the next batch number; a
restore starts there (unshuffled, by reading past the earlier chunks).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

from pipelines._batching import BatchingConfig, BatchPlan, RecordFiles
from pipelines._host_iterator import HostIterator
from pipelines._preprocess_stage import (
    HostBatch,
    PreprocessConfig,
    PreprocessStage,
    check_batch_sizes,
)
from pipelines._records import (
    PathOrPaths,
    RecordFormat,
    list_record_files,
    require_record_format,
    tf_error_reason,
)
from pipelines._shuffle import batch_plan
from pipelines._stats import PipelineStats
from pipelines._tensorflow import tf
from pipelines._tfrecord_index import IndexedTFRecordFiles

_COUNT_BATCH = 4096
_PREFETCH = 2


class TFRecordReader:
    """Reads TFRecord records by dataset index.

    Args:
      paths: the files, in dataset order.
      indexed: index the record offsets (`IndexedTFRecordFiles`) for reads
        by offset; else a read scans the files (for rare fill-ins).
    """

    def __init__(self, paths: list[str], *, indexed: bool = False):
        require_record_format(paths, RecordFormat.TFRECORD, "tf.data", "make_grain_iterator")
        self._index = IndexedTFRecordFiles(paths) if indexed else None
        if self._index is not None:
            counts = self._index.counts
        else:
            counts = tuple(_count_records(path) for path in paths)
        self._files = RecordFiles(tuple(paths), counts)

    @property
    def files(self) -> RecordFiles:
        return self._files

    def read(self, record_indices: Sequence[int]) -> list[bytes]:
        if self._index is not None:
            return self._index.read(record_indices)
        records = []
        for start, stop in _runs([int(i) for i in record_indices]):
            dataset = tf.data.TFRecordDataset(list(self._files.paths)).skip(start)
            records.extend(_numpy_records(dataset.take(stop - start), self._files.paths))
        return records


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """`indices` as maximal runs `[start, stop)` of consecutive values, in order."""
    runs: list[tuple[int, int]] = []
    for index in indices:
        if runs and runs[-1][1] == index:
            runs[-1] = (runs[-1][0], index + 1)
        else:
            runs.append((index, index + 1))
    return runs


def _count_records(path: str) -> int:
    dataset = tf.data.TFRecordDataset(path).batch(_COUNT_BATCH)
    try:
        return int(dataset.reduce(tf.constant(0, tf.int64), lambda n, b: n + tf.size(b, tf.int64)))
    except tf.errors.OpError as error:
        raise ValueError(
            f"{path}: corrupt or truncated TFRecord file: {tf_error_reason(error)}"
        ) from error


def _numpy_records(dataset: tf.data.Dataset, paths) -> list[bytes]:
    try:
        return list(dataset.as_numpy_iterator())
    except tf.errors.OpError as error:
        raise ValueError(
            f"Reading {list(paths)}: corrupt or truncated TFRecord file: {tf_error_reason(error)}"
        ) from error


class _TFDataSource:
    """Host batches from a tf.data stream of this host's record chunks."""

    def __init__(self, plan: BatchPlan, reader: TFRecordReader, stage: PreprocessStage):
        self._plan = plan
        self._reader = reader
        # Fill-in records come from the same plan and reader as the batch's own.
        self._stage = functools.partial(stage, plan=plan, reader=reader)
        self._next_batch = 0
        self._chunks = None

    def _stream(self, start: int):
        config = self._plan.config
        if config.shuffle_seed is not None:
            dataset = (
                tf.data.Dataset.range(start, self._plan.num_batches)
                .map(self._host_rows)
                .prefetch(_PREFETCH)
            )
            return iter(dataset)
        dataset = (
            tf.data.TFRecordDataset(list(self._reader.files.paths))
            .take(self._plan.batches_per_epoch * config.global_batch_size)
            .batch(config.host_batch_size, drop_remainder=True)
            .shard(config.process_count, config.process_index)
            .repeat(config.num_epochs)
            .skip(start)
            .prefetch(_PREFETCH)
        )
        return iter(dataset)

    def _host_rows(self, batch_number: tf.Tensor) -> tf.Tensor:
        """`string[host_batch]` this host's records of a global batch (in its shuffled order)."""
        rows = tf.py_function(
            lambda b: tf.constant(list(self._reader.read(self._plan.record_indices(int(b))))),
            [batch_number],
            tf.string,
        )
        rows.set_shape([self._plan.config.host_batch_size])
        return rows

    def __next__(self) -> HostBatch:
        batch_number = self._next_batch
        if batch_number >= self._plan.num_batches:
            raise StopIteration
        if self._chunks is None:
            self._chunks = self._stream(batch_number)
        start = time.perf_counter()
        try:
            chunk = next(self._chunks)
        except StopIteration:
            raise RuntimeError(
                f"The TFRecord files {list(self._reader.files.paths)} ended before batch "
                f"{batch_number} of {self._plan.num_batches}; did they change while read?"
            ) from None
        except tf.errors.OpError as error:
            raise ValueError(
                f"Reading {list(self._reader.files.paths)}: corrupt or truncated TFRecord "
                f"file: {tf_error_reason(error)}"
            ) from error
        records = chunk.numpy().tolist()
        batch = self._stage(batch_number, records, read_s=time.perf_counter() - start)
        self._next_batch += 1
        return batch

    def get_state(self) -> dict:
        return {"next_batch": self._next_batch}

    def set_state(self, state: dict) -> None:
        self._next_batch = int(state["next_batch"])
        self._chunks = None

    def start_prefetch(self) -> None:
        if self._chunks is None:
            self._chunks = self._stream(self._next_batch)

    def close(self) -> None:
        self._chunks = None


def make_tfdata_iterator(
    data: PathOrPaths,
    *,
    batching: BatchingConfig,
    preprocess: PreprocessConfig,
    log_interval_s: float | None = 60.0,
) -> HostIterator:
    """This host's preprocessed batches of a TFRecord dataset, through tf.data.

    The batches equal those of `make_grain_iterator` over the same records
    in ArrayRecord files, with the same `shuffle_seed` (or none).

    Args:
      data: TFRecord files, directories or glob patterns.
      batching: global batch, hosts and shuffle: with a `shuffle_seed` the
        records are read in the Grain path's shuffled order (the files are
        indexed first: one pass over their length fields), else in file
        order.
      preprocess: parsing and preprocessing, as for the Grain path.
      log_interval_s: seconds between logged stats summaries (None: never).

    Returns:
      A `HostIterator` of `num_batches` `HostBatch`es. Close it (or use `with`).

    Raises:
      ValueError: inconsistent settings, unreadable files, or a dataset
        smaller than one global batch.
    """
    check_batch_sizes(batching, preprocess)
    shuffled = batching.shuffle_seed is not None
    reader = TFRecordReader(list_record_files(data), indexed=shuffled)
    plan = batch_plan(reader.files.num_records, batching)
    stage = PreprocessStage(preprocess)
    pipeline = {"path": "tfdata", "num_records": plan.num_records, **dataclasses.asdict(batching)}
    return HostIterator(
        _TFDataSource(plan, reader, stage),
        pipeline=pipeline,
        num_batches=plan.num_batches,
        stats=PipelineStats("tf.data input", log_interval_s=log_interval_s),
        on_close=stage.close,
    )
