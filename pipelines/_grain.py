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

Each worker reports its pid as it starts and when it made the last batch of
its share (`GrainWorkers`), so that one that dies is named in an
`InputWorkerError`, one that Grain ended once done is not, and closing the iterator takes a
bounded time even when a worker is dead or stopped.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import gc
import logging
import os
import threading
import time

import grain
import numpy as np
from absl import flags

import embedding
from embedding.checks import check_int
from parallel import allreduce
from pipelines._array_record import ArrayRecordReader
from pipelines._batching import BatchingConfig, BatchPlan
from pipelines._grain_workers import GrainWorkers
from pipelines._host_iterator import HostIterator
from pipelines._packing import packed_shape
from pipelines._preprocess_stage import (
    HostBatch,
    PreprocessConfig,
    PreprocessStage,
    check_batch_sizes,
    checked_enum,
)
from pipelines._records import PathOrPaths, list_record_files
from pipelines._shared_buffers import SharedBatchBuffers
from pipelines._shuffle import batch_plan
from pipelines._stats import PipelineStats

_log = logging.getLogger(__name__)
_NO_SHARED_MEMORY = 2**62
# How long a close waits for Grain's, before and after killing the workers.
_CLOSE_S = 10.0
# (worker index, worker count) of this process when it is a Grain worker.
_worker: tuple[int, int] | None = None


class WorkerPriority(str, enum.Enum):
    """The CPU scheduling of Grain worker processes."""

    IDLE = "idle"
    """Run only on CPU time nothing else wants (Linux `SCHED_IDLE`): the
    training step, whose device threads need every core at each collective,
    is never delayed by input work; the workers keep up as long as the step
    leaves cores idle part of the time."""
    NORMAL = "normal"
    """Share the cores with the training process as equals."""


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
      worker_priority: the workers' CPU scheduling (`WorkerPriority`).
      shared_buffers: batches each worker can hand over in shared memory
        without a copy (`SharedBatchBuffers`); beyond that many batches alive
        in this process, or with 0, batches travel pickled.
    """

    worker_count: int = 0
    worker_buffer_size: int = 2
    read_threads: int = 1
    read_buffer_size: int = 2
    worker_priority: WorkerPriority = WorkerPriority.IDLE
    shared_buffers: int = 16

    def __post_init__(self):
        for name, minimum in (
            ("worker_count", 0),
            ("worker_buffer_size", 1),
            ("read_threads", 1),
            ("read_buffer_size", 1),
            ("shared_buffers", 0),
        ):
            value = getattr(self, name)
            check_int(value, name, minimum)
        priority = checked_enum(WorkerPriority, self.worker_priority, "worker_priority")
        object.__setattr__(self, "worker_priority", priority)


def init_grain_worker(
    worker_index: int,
    worker_count: int,
    *,
    priority: WorkerPriority = WorkerPriority.IDLE,
    workers: GrainWorkers | None = None,
) -> None:
    """Grain's `worker_init_fn` for workers that lay batches out (`mp_prefetch`).

    Sets the worker's CPU priority and makes it join agreement group
    `worker_index` (the ports of `agreement.for_worker(worker_index)`), so
    that worker w of every host agrees on the minibatching of the batches
    `b = w, w + W, ...` it receives; `LayOutBatch` checks that it receives
    those. With `workers`, the worker reports its pid there first, so that
    the training process can name it if it dies.
    """
    global _worker
    if workers is not None:
        workers.register(worker_index)
    priority = checked_enum(WorkerPriority, priority, "priority")
    if priority is WorkerPriority.IDLE:
        _idle_priority()
    # The worker's imports (numpy, jax, TensorFlow, Grain: half a million
    # objects) live as long as it does. Frozen, the full collections the
    # batches' garbage triggers skip them; unfrozen, each one walks them all
    # (a quarter second of CPU in the demo's worker).
    gc.collect()
    gc.freeze()
    allreduce.init_agreement_worker(worker_index, worker_count)
    _worker = (worker_index, worker_count)


def _idle_priority() -> None:
    """Puts every thread of this process under `SCHED_IDLE` (threads started later inherit it)."""
    if not hasattr(os, "sched_setscheduler"):
        _log.warning("This platform has no SCHED_IDLE; the Grain worker runs at normal priority.")
        return
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(task), os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:  # the thread ended meanwhile
            continue


def check_worker_batch(batch_number: int) -> None:
    """Checks that batch `batch_number` reached the worker whose group agrees on it.

    Raises:
      RuntimeError: in a worker set up by `init_grain_worker`, a batch of
        another worker (the hosts' workers would wait on different batches).
    """
    if _worker is not None and batch_number % _worker[1] != _worker[0]:
        # The agreement groups rely on Grain's slicing of the batches.
        raise RuntimeError(
            f"Batch {batch_number} reached worker {_worker[0]} of {_worker[1]}, not "
            f"worker {batch_number % _worker[1]}: the hosts' workers would disagree. "
            "Lay batches out in a dataset whose index is the batch number (a MapDataset "
            "up to mp_prefetch, no filter or shuffle of whole batches after it)."
        )


class _PrepareBatch:
    """The map of the Grain dataset: batch number -> `HostBatch`."""

    def __init__(
        self,
        plan: BatchPlan,
        reader: ArrayRecordReader,
        stage: PreprocessStage,
        buffers: SharedBatchBuffers | None,
        workers: GrainWorkers | None,
    ):
        self._plan = plan
        self._reader = reader
        # Fill-in records come from the same plan and reader as the batch's own.
        self._stage = functools.partial(stage, plan=plan, reader=reader)
        self._buffers = buffers
        self._workers = workers

    def __call__(self, batch_number: int) -> HostBatch:
        batch_number = int(batch_number)
        check_worker_batch(batch_number)
        start = time.perf_counter()
        records = self._reader.read(self._plan.record_indices(batch_number))
        batch = self._stage(
            batch_number,
            records,
            read_s=time.perf_counter() - start,
            allocate=self._shared_buffer if self._buffers is not None else None,
        )
        if (
            _worker is not None
            and self._workers is not None
            and batch_number + _worker[1] >= self._plan.num_batches
        ):
            self._workers.made_last_batch(_worker[0])
        return batch

    def _shared_buffer(self):
        # In this process (no worker) a batch is not pickled: no slot needed.
        return None if _worker is None else self._buffers.acquire(_worker[0])


class _GrainSource:
    """A Grain iterator as a `BatchSource`; dropped on close so teardown stays quiet."""

    def __init__(self, dataset: grain.IterDataset, workers: GrainWorkers | None):
        self._iterator = iter(dataset)
        self._workers = workers

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
        if self._workers is None:
            iterator.close()
            return
        # Once a worker died the input is over: the others are killed rather
        # than asked to stop, which takes a worker at idle priority on a busy
        # host long.
        killed = self._workers.any_failed()
        if killed:
            self._workers.kill()
        # Grain's close waits for its reader of each worker, which waits for
        # what the worker sends, forever if it is stopped: past a bound the
        # workers are killed, which ends those waits, and Grain's close may
        # then fail on what they left half-sent.
        failure: list[Exception] = []
        closing = threading.Thread(
            target=_close_grain,
            args=(iterator, failure),
            name="sparseflow-grain-close",
            daemon=True,
        )
        closing.start()
        closing.join(_CLOSE_S)
        if closing.is_alive() and not killed:
            killed = True
            self._workers.kill()
            closing.join(_CLOSE_S)
        self._workers.close()
        if closing.is_alive():
            _log.warning(
                "The Grain iterator did not close within %.0f s of its workers being killed; "
                "its threads are left to end with the process.",
                _CLOSE_S,
            )
        elif failure and killed:
            _log.info("Grain's close, after its workers were killed: %r", failure[0])
        elif failure:
            raise failure[0]


def _close_grain(iterator, failure: list[Exception]) -> None:
    try:
        iterator.close()
    except Exception as error:  # handed to `_GrainSource.close`
        failure.append(error)


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
    dataset, plan, stage, buffers, workers = grain_dataset(
        data, batching=batching, preprocess=preprocess, options=options
    )

    def close() -> None:
        stage.close()
        if buffers is not None:
            buffers.close()

    pipeline = {
        "path": "grain",
        "num_records": plan.num_records,
        **dataclasses.asdict(batching),
        "worker_count": options.worker_count,
    }
    return HostIterator(
        _GrainSource(dataset, workers),
        pipeline=pipeline,
        num_batches=plan.num_batches,
        stats=PipelineStats("grain input", log_interval_s=log_interval_s),
        on_close=close,
        workers=workers,
    )


def grain_dataset(
    data: PathOrPaths,
    *,
    batching: BatchingConfig,
    preprocess: PreprocessConfig,
    options: GrainOptions = GrainOptions(),
) -> tuple[
    grain.IterDataset, BatchPlan, PreprocessStage, SharedBatchBuffers | None, GrainWorkers | None
]:
    """The Grain dataset of `make_grain_iterator`, with its plan, stage, buffers and workers.

    Iterate the dataset once at a time: its workers own the shared buffers
    and report to `GrainWorkers`.

    Returns:
      `(dataset of HostBatch, the batch plan, the preprocessing stage, the
      workers' shared buffers or None, the workers' `GrainWorkers` or None)`;
      close the stage, the buffers and the workers after the iterator.
    """
    check_batch_sizes(batching, preprocess)
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    reader = ArrayRecordReader(list_record_files(data))
    plan = batch_plan(reader.files.num_records, batching)
    stage = PreprocessStage(preprocess)
    buffers = _shared_buffers(preprocess, options)
    workers = GrainWorkers(options.worker_count, plan.num_batches) if options.worker_count else None
    dataset = (
        grain.MapDataset.range(plan.num_batches)
        .map(_PrepareBatch(plan, reader, stage, buffers, workers))
        .to_iter_dataset(
            grain.ReadOptions(
                num_threads=options.read_threads,
                prefetch_buffer_size=options.read_buffer_size,
            )
        )
    )
    if options.worker_count:
        # Grain's own shared memory (a new block per array, freed from a
        # background thread and leaked at exit) stays off: the packed layout
        # travels in `buffers`, the rest of a batch pickled.
        dataset = grain.experimental.WithOptionsIterDataset(
            dataset, grain.experimental.DatasetOptions(min_shm_size=_NO_SHARED_MEMORY)
        ).mp_prefetch(
            grain.MultiprocessingOptions(
                num_workers=options.worker_count,
                per_worker_buffer_size=options.worker_buffer_size,
            ),
            worker_init_fn=functools.partial(
                init_grain_worker, priority=options.worker_priority, workers=workers
            ),
        )
    return dataset, plan, stage, buffers, workers


def batch_record_indices(
    data: PathOrPaths, batching: BatchingConfig, batch_number: int
) -> np.ndarray:
    """`int64[n]` the dataset records of this host's rows of a batch of `make_grain_iterator`.

    A record's index counts the records of `data`'s files in order (the
    planned records: a bad one skipped is replaced in its batch by another).
    """
    num_records = ArrayRecordReader(list_record_files(data)).files.num_records
    return batch_plan(num_records, batching).record_indices(batch_number)


def num_records(data: PathOrPaths) -> int:
    """Records of an ArrayRecord dataset, as `make_grain_iterator` numbers them."""
    return ArrayRecordReader(list_record_files(data)).files.num_records


def batch_layout_stats(
    data: PathOrPaths, batching: BatchingConfig, preprocess: PreprocessConfig, batch_number: int
) -> embedding.SparseDenseMatmulInputStats:
    """The layout stats of this host's rows of a batch of `make_grain_iterator`, in this process.

    The stats count every id, as they are before any dropping or minibatching:
    what the batch needs of each table's limits.
    """
    reader = ArrayRecordReader(list_record_files(data))
    plan = batch_plan(reader.files.num_records, batching)
    counting = dataclasses.replace(
        preprocess, allow_id_dropping=True, enable_minibatching=False, agreement=None
    )
    records = reader.read(plan.record_indices(batch_number))
    return PreprocessStage(counting).layout_stats(batch_number, records, plan=plan, reader=reader)


def _shared_buffers(
    preprocess: PreprocessConfig, options: GrainOptions
) -> SharedBatchBuffers | None:
    """The workers' shared buffers, or None (no workers, none asked for, or no room)."""
    if not options.worker_count or not options.shared_buffers:
        return None
    try:
        return SharedBatchBuffers(
            workers=options.worker_count,
            slots=options.shared_buffers,
            shape=packed_shape(
                preprocess.preprocessed_input_shapes(), preprocess.local_device_count
            ),
        )
    except OSError as error:
        _log.warning(
            "No shared memory for %d x %d batch buffers (%s): batches travel from the "
            "Grain workers pickled, which costs this process a copy of each.",
            options.worker_count,
            options.shared_buffers,
            error,
        )
        return None
