"""The iterator of host batches both input paths return: stats, checkpoints, cleanup.

Its state is JSON bytes holding the path's own state, the next batch number
and a description of the pipeline it belongs to, so a state saved by another
pipeline (another dataset size, batch, host or worker count) is refused with
a clear message instead of silently reading other batches. The state format
is what Grain's orbax handler (`grain.checkpoint.CheckpointHandler`) expects
of a non-Grain iterator: `get_state() -> bytes`, `set_state(bytes)` and
`start_prefetch()`.

Example:
  import orbax.checkpoint as ocp
  checkpointer = ocp.Checkpointer(grain.checkpoint.CheckpointHandler())
  checkpointer.save(path, args=grain.checkpoint.CheckpointSave(iterator))
  ...
  checkpointer.restore(path, args=grain.checkpoint.CheckpointRestore(iterator))
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from pipelines._preprocess_stage import HostBatch
from pipelines._stats import PipelineStats

_STATE_VERSION = 1


class BatchSource(Protocol):
    """What an input path provides: host batches, a JSON-able state, cleanup."""

    def __next__(self) -> HostBatch: ...

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...

    def start_prefetch(self) -> None: ...

    def close(self) -> None: ...


class Workers(Protocol):
    """The worker processes of an input path, watched so that errors can name them."""

    def check(self, due: int, *, after_error: bool = False) -> None:
        """Raises `InputWorkerError` if a worker ended; batch `due` is awaited.

        `after_error`: the path raised an error of its own (a worker's, passed
        on), after which a worker the path stopped on purpose is not a failure.
        """

    def describe(self, batch_number: int) -> str:
        """Who prepares batch `batch_number` (a worker, its pid and state)."""


class HostIterator(Iterator[HostBatch]):
    """Yields this host's preprocessed batches, in batch order.

    Use it as a context manager (or call `close()`): worker processes, reader
    threads and all-reduce servers stop there.

    Args:
      source: the input path's batches.
      pipeline: what identifies the pipeline in a saved state (JSON-able).
      num_batches: batches the iterator yields in all.
      stats: where batches are counted.
      on_close: called once by `close()`.
      workers: the source's worker processes, or None (it has none).
    """

    def __init__(
        self,
        source: BatchSource,
        *,
        pipeline: Mapping[str, Any],
        num_batches: int,
        stats: PipelineStats,
        on_close: Callable[[], None] = lambda: None,
        workers: Workers | None = None,
    ):
        self._source: BatchSource | None = source
        self._pipeline = dict(pipeline)
        self._num_batches = num_batches
        self._stats = stats
        self._on_close = on_close
        self._workers = workers
        self._next_batch = 0

    @property
    def num_batches(self) -> int:
        """The batches of the whole run (every epoch), the same on every host."""
        return self._num_batches

    @property
    def next_batch(self) -> int:
        """The number of the batch `next()` returns."""
        return self._next_batch

    @property
    def pipeline_stats(self) -> PipelineStats:
        return self._stats

    def stats(self) -> dict:
        """The per-stage statistics so far (see `PipelineStats.as_dict`)."""
        return self._stats.as_dict()

    def __iter__(self) -> HostIterator:
        return self

    def __next__(self) -> HostBatch:
        """The next batch.

        Raises:
          InputWorkerError: a worker process ended.
        """
        source = self._live_source()
        start = time.perf_counter()
        try:
            batch = next(source)
        except StopIteration:
            raise
        except Exception:
            # A worker's death reaches here as the path's own error (Grain's
            # RuntimeError), which does not say which worker it was. A worker's
            # own error (a bad batch, a limit breach) reaches here as itself,
            # and the worker that raised it is stopped: the error stands.
            self._check_workers(after_error=True)
            raise
        # Every batch checks, so that a worker is known while it lives: once
        # ended, it may no longer be found.
        self.check_workers()
        if batch.batch_number != self._next_batch:
            raise RuntimeError(
                f"The input pipeline produced batch {batch.batch_number} where batch "
                f"{self._next_batch} was due; its order is broken."
            )
        self._stats.add_batch(batch.report, time.perf_counter() - start)
        self._next_batch += 1
        return batch

    def check_workers(self) -> None:
        """Raises `InputWorkerError` if a worker process ended (safe from any thread)."""
        self._check_workers(after_error=False)

    def _check_workers(self, *, after_error: bool) -> None:
        if self._workers is not None:
            self._workers.check(self._next_batch, after_error=after_error)

    def awaited(self) -> str:
        """The batch `next()` waits for and who prepares it, for errors (safe from any thread)."""
        awaited = f"batch {self._next_batch} of {self._num_batches}"
        if self._workers is None:
            return awaited
        return f"{awaited}, prepared by {self._workers.describe(self._next_batch)}"

    def get_state(self) -> bytes:
        """The position after the last batch returned, as JSON bytes."""
        state = {
            "version": _STATE_VERSION,
            "pipeline": self._pipeline,
            "next_batch": self._next_batch,
            "source": self._live_source().get_state(),
        }
        return json.dumps(state, sort_keys=True).encode()

    def set_state(self, state: bytes | str) -> None:
        """Continues from a state of `get_state`, saved by the same pipeline.

        Raises:
          ValueError: the state is not one of these, or another pipeline's.
        """
        try:
            decoded = json.loads(state)
            version, pipeline = decoded["version"], decoded["pipeline"]
            next_batch, source_state = decoded["next_batch"], decoded["source"]
        except (ValueError, TypeError, KeyError) as error:
            raise ValueError(f"Not an input iterator state: {str(state)[:200]!r}") from error
        if version != _STATE_VERSION:
            raise ValueError(f"Input iterator state version {version} is not {_STATE_VERSION}.")
        if pipeline != self._pipeline:
            differences = {
                key: (pipeline.get(key), self._pipeline.get(key))
                for key in sorted(set(pipeline) | set(self._pipeline))
                if pipeline.get(key) != self._pipeline.get(key)
            }
            raise ValueError(
                "The input state was saved by another pipeline; (saved, this) differ in "
                f"{differences}. Restore it into a pipeline built with the same settings."
            )
        self._live_source().set_state(source_state)
        self._next_batch = next_batch

    def start_prefetch(self) -> None:
        """Starts preparing batches in the background before the first `next()`."""
        self._live_source().start_prefetch()

    def close(self) -> None:
        """Stops the workers and threads; the iterator is unusable afterwards."""
        if self._source is None:
            return
        source, self._source = self._source, None
        try:
            source.close()
        finally:
            self._on_close()

    def __enter__(self) -> HostIterator:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _live_source(self) -> BatchSource:
        if self._source is None:
            raise ValueError("The input iterator is closed.")
        return self._source
