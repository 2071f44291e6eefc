"""The Grain input path: ArrayRecord files -> preprocessed host batches.

The dataset is a Grain `MapDataset` over this host's batch numbers
`0..num_batches-1` (see `_batching.py` for which records each holds):

    MapDataset.range(num_batches)
      .map(batch b -> read this host's rows of global batch b from the
           ArrayRecord files (`_array_record.py`), in the epoch's order
           (Grain's global shuffle, `MapDataset.range(R).shuffle(seed)`,
           computed per batch by `_shuffle.py`), parse them, preprocess them)
      .to_iter_dataset(read threads)
      .mp_prefetch(worker processes)

`mp_prefetch` gives worker w of W the batches `b = w, w + W, ...`, on every
host alike, so worker w of every host sees the same batches: each worker
process joins its own all-reduce group (ports of
`agreement.for_worker(w)`, created lazily inside the worker), and batch b is
agreed on with key `2 * b` by the workers `b mod W` of all hosts.

The iterator's state is Grain's (per-worker positions), so a restored run
continues with exactly the batches an uninterrupted run would have produced,
on the same workers. Restoring needs the same worker count.
"""

from __future__ import annotations

import dataclasses
import time

import grain
import numpy as np
from absl import flags

from parallel import allreduce
from pipelines._array_record import ArrayRecordReader
from pipelines._batching import BatchingConfig, BatchPlan, FileOrder
from pipelines._host_iterator import HostIterator
from pipelines._preprocess_stage import (
    HostBatch,
    PreprocessConfig,
    PreprocessStage,
    check_batch_sizes,
)
from pipelines._records import PathOrPaths, list_record_files
from pipelines._shuffle import grain_epoch_order
from pipelines._stats import PipelineStats

_NO_SHARED_MEMORY = 2**62
# (worker index, worker count) of this process when it is a Grain worker.
_worker: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class GrainOptions:
    """How the Grain path runs.

    Attributes:
      worker_count: W, worker processes preparing batches (0: in this
        process). Every host must use the same count, and a checkpoint
        restores into the same count only.
      worker_buffer_size: batches each worker prepares ahead.
      read_threads: threads preparing batches in each process (each thread
        works on its own batch).
      read_buffer_size: batches each process's threads keep ready.
    """

    worker_count: int = 0
    worker_buffer_size: int = 2
    read_threads: int = 1
    read_buffer_size: int = 2

    def __post_init__(self):
        for name, minimum in (
            ("worker_count", 0),
            ("worker_buffer_size", 1),
            ("read_threads", 1),
            ("read_buffer_size", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")


class GrainShuffle:
    """Grain's global shuffle as an `EpochOrder`: a new permutation per epoch.

    Position `i` of epoch `e` is record `MapDataset.range(R).shuffle(seed)[e * R + i]`.
    """

    def __init__(self, num_records: int, seed: int):
        self._num_records = num_records
        self._seed = seed

    def __call__(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        return grain_epoch_order(self._num_records, self._seed, epoch, positions)


def _init_worker(worker_index: int, worker_count: int) -> None:
    """Grain's `worker_init_fn`: joins worker `worker_index`'s agreement group."""
    global _worker
    allreduce.init_agreement_worker(worker_index, worker_count)
    _worker = (worker_index, worker_count)


class _PrepareBatch:
    """The map of the Grain dataset: batch number -> `HostBatch`."""

    def __init__(self, plan: BatchPlan, reader: ArrayRecordReader, stage: PreprocessStage):
        self._plan = plan
        self._reader = reader
        self._stage = stage

    def __call__(self, batch_number: int) -> HostBatch:
        batch_number = int(batch_number)
        if _worker is not None and batch_number % _worker[1] != _worker[0]:
            # The agreement groups rely on Grain's slicing of the batches.
            raise RuntimeError(
                f"Batch {batch_number} reached worker {_worker[0]} of {_worker[1]}, not "
                f"worker {batch_number % _worker[1]}: the hosts' workers would disagree."
            )
        start = time.perf_counter()
        records = self._reader.read(self._plan.record_indices(batch_number))
        return self._stage(
            batch_number,
            records,
            plan=self._plan,
            reader=self._reader,
            read_s=time.perf_counter() - start,
        )


class _GrainSource:
    """A Grain iterator as a `BatchSource`; dropped on close so teardown stays quiet."""

    def __init__(self, dataset: grain.IterDataset):
        self._iterator = iter(dataset)

    def __next__(self) -> HostBatch:
        return next(self._iterator)

    def get_state(self):
        return self._iterator.get_state()

    def set_state(self, state) -> None:
        self._iterator.set_state(state)

    def start_prefetch(self) -> None:
        start = getattr(self._iterator, "start_prefetch", None)
        if start is not None:
            start()

    def close(self) -> None:
        iterator, self._iterator = self._iterator, None
        iterator.close()


def make_grain_iterator(
    data: PathOrPaths,
    *,
    batching: BatchingConfig,
    preprocess: PreprocessConfig,
    options: GrainOptions = GrainOptions(),
    log_interval_s: float | None = 60.0,
) -> HostIterator:
    """This host's preprocessed batches of an ArrayRecord dataset, through Grain.

    Outside `absl.app.run`, absl flags (which Grain reads) are marked parsed.

    Args:
      data: ArrayRecord files, directories or glob patterns
        (`list_record_files`).
      batching: order, global batch and hosts (`shuffle_seed` shuffles
        globally, differently in every epoch).
      preprocess: parsing and preprocessing; its specs' global batch must
        equal `batching.global_batch_size`.
      options: worker processes and threads.
      log_interval_s: seconds between logged stats summaries (None: never).

    Returns:
      A `HostIterator` of `HostBatch`es: `num_batches` batches, the same
      number on every host. Close it (or use `with`).

    Raises:
      ValueError: inconsistent settings, or a dataset smaller than one
        global batch.
    """
    dataset, plan, stage = grain_dataset(
        data, batching=batching, preprocess=preprocess, options=options
    )
    pipeline = {
        "path": "grain",
        "num_records": plan.num_records,
        **dataclasses.asdict(batching),
        "worker_count": options.worker_count,
    }
    return HostIterator(
        _GrainSource(dataset),
        pipeline=pipeline,
        num_batches=plan.num_batches,
        stats=PipelineStats("grain input", log_interval_s=log_interval_s),
        on_close=stage.close,
    )


def grain_dataset(
    data: PathOrPaths,
    *,
    batching: BatchingConfig,
    preprocess: PreprocessConfig,
    options: GrainOptions = GrainOptions(),
) -> tuple[grain.IterDataset, BatchPlan, PreprocessStage]:
    """The Grain dataset of `make_grain_iterator`, with its plan and stage.

    Returns:
      `(dataset of HostBatch, the batch plan, the preprocessing stage)`.
    """
    check_batch_sizes(batching, preprocess)
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    reader = ArrayRecordReader(list_record_files(data))
    num_records = reader.files.num_records
    order = (
        FileOrder()
        if batching.shuffle_seed is None
        else GrainShuffle(num_records, batching.shuffle_seed)
    )
    plan = BatchPlan(config=batching, num_records=num_records, order=order)
    stage = PreprocessStage(preprocess)
    dataset = (
        grain.MapDataset.range(plan.num_batches)
        .map(_PrepareBatch(plan, reader, stage))
        .to_iter_dataset(
            grain.ReadOptions(
                num_threads=options.read_threads,
                prefetch_buffer_size=options.read_buffer_size,
            )
        )
    )
    if options.worker_count:
        # Batches travel from the workers pickled, not in shared memory, which
        # Grain frees from a background thread and leaks at exit.
        dataset = grain.experimental.WithOptionsIterDataset(
            dataset, grain.experimental.DatasetOptions(min_shm_size=_NO_SHARED_MEMORY)
        ).mp_prefetch(
            grain.MultiprocessingOptions(
                num_workers=options.worker_count,
                per_worker_buffer_size=options.worker_buffer_size,
            ),
            worker_init_fn=_init_worker,
        )
    return dataset, plan, stage
