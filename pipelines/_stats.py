"""Per-stage statistics of an input pipeline.

Each host batch carries a `BatchReport` made where it was prepared (a Grain
worker process, or the main process): how many records it read and skipped,
the seconds spent reading, parsing and preprocessing it, and the ids the
preprocessing dropped. The iterator that hands batches out adds them to a
`PipelineStats`, together with the time its caller waited and the time spent
placing batches on devices, and logs a summary every `log_interval_s`.

Stage times are sums over batches: batches prepared in parallel (worker
processes, reader threads) add up to more than the wall time. The wait times
are what the caller actually lost: `device_wait_s` (or `host_wait_s` when
host batches are consumed directly) is the input stall of a training loop.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

_log = logging.getLogger(__name__)


class BatchReport(NamedTuple):
    """What preparing one host batch took.

    Attributes:
      records: records read for the batch, bad ones and fill-ins included.
      bad_records: records of the batch's own span skipped as bad.
      read_s: seconds reading records.
      parse_s: seconds parsing them.
      preprocess_s: seconds laying them out for the devices.
      dropped_ids: per stacked table, ids dropped by the limits.
      invalid_ids: per stacked table, out-of-vocabulary ids dropped.
      num_minibatches: minibatches of the batch (1 without minibatching).
    """

    records: int
    bad_records: int
    read_s: float
    parse_s: float
    preprocess_s: float
    dropped_ids: Mapping[str, int]
    invalid_ids: Mapping[str, int]
    num_minibatches: int


_STAGE_SECONDS = ("read_s", "parse_s", "preprocess_s")
_LOOP_SECONDS = ("host_wait_s", "device_put_s", "device_wait_s")


class PipelineStats:
    """Running totals of a pipeline's stages; safe to update from several threads.

    Args:
      name: names the pipeline in log lines.
      log_interval_s: seconds between two summaries logged at INFO level
        (`None`: never log).
      clock: a monotonic clock in seconds (tests pass a fake one).
    """

    def __init__(
        self,
        name: str,
        *,
        log_interval_s: float | None = 60.0,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if log_interval_s is not None and not log_interval_s > 0:
            raise ValueError(f"log_interval_s must be > 0 or None, got {log_interval_s!r}.")
        self._name = name
        self._log_interval_s = log_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._start = clock()
        self._last_log = self._start
        self._batches = 0
        self._minibatched = 0
        self._records = 0
        self._bad_records = 0
        self._seconds = dict.fromkeys(_STAGE_SECONDS + _LOOP_SECONDS, 0.0)
        self._dropped: collections.Counter[str] = collections.Counter()
        self._invalid: collections.Counter[str] = collections.Counter()

    def add_batch(self, report: BatchReport, host_wait_s: float) -> None:
        """Counts a host batch handed out after its caller waited `host_wait_s`."""
        with self._lock:
            self._batches += 1
            self._minibatched += report.num_minibatches > 1
            self._records += report.records
            self._bad_records += report.bad_records
            for key in _STAGE_SECONDS:
                self._seconds[key] += getattr(report, key)
            self._seconds["host_wait_s"] += host_wait_s
            self._dropped.update(report.dropped_ids)
            self._invalid.update(report.invalid_ids)
        self._maybe_log()

    def add_device_put(self, seconds: float) -> None:
        """Counts time spent placing a batch on the devices."""
        with self._lock:
            self._seconds["device_put_s"] += seconds

    def add_device_wait(self, seconds: float) -> None:
        """Counts time the caller waited for a batch already on the devices."""
        with self._lock:
            self._seconds["device_wait_s"] += seconds

    def as_dict(self) -> dict:
        """The totals so far.

        Returns:
          A dict with `batches`, `records`, `bad_records`, `minibatched_batches`,
          `dropped_ids` and `invalid_ids` (totals) with their per-table dicts
          `dropped_ids_per_table` and `invalid_ids_per_table`, the stage times
          `read_s`, `parse_s`, `preprocess_s`, `device_put_s`, the waits
          `host_wait_s` and `device_wait_s`, `elapsed_s` since the pipeline
          started, and the rates `records_per_s` and `batches_per_s`.
        """
        with self._lock:
            elapsed = max(self._clock() - self._start, 1e-9)
            return {
                "batches": self._batches,
                "records": self._records,
                "bad_records": self._bad_records,
                "minibatched_batches": self._minibatched,
                "dropped_ids": sum(self._dropped.values()),
                "invalid_ids": sum(self._invalid.values()),
                "dropped_ids_per_table": dict(self._dropped),
                "invalid_ids_per_table": dict(self._invalid),
                **self._seconds,
                "elapsed_s": elapsed,
                "records_per_s": self._records / elapsed,
                "batches_per_s": self._batches / elapsed,
            }

    def _maybe_log(self) -> None:
        if self._log_interval_s is None:
            return
        now = self._clock()
        with self._lock:
            if now - self._last_log < self._log_interval_s:
                return
            self._last_log = now
        self.log()

    def log(self) -> None:
        """Logs a one-line summary of the totals at INFO level."""
        s = self.as_dict()
        _log.info(
            "%s: %d batches, %.0f records/s, %.2f batches/s; seconds in read %.1f, "
            "parse %.1f, preprocess %.1f, device put %.1f, waiting %.1f (host) %.1f "
            "(device); %d bad records skipped, %d ids dropped, %d invalid ids, "
            "%d batches minibatched",
            self._name,
            s["batches"],
            s["records_per_s"],
            s["batches_per_s"],
            s["read_s"],
            s["parse_s"],
            s["preprocess_s"],
            s["device_put_s"],
            s["host_wait_s"],
            s["device_wait_s"],
            s["bad_records"],
            s["dropped_ids"],
            s["invalid_ids"],
            s["minibatched_batches"],
        )
