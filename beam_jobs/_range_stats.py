"""The file-order stats of a bundle of ranges: their whole batches folded, fragments kept.

The batches are those of `beam_jobs._batches`: a range's good records are
numbered from the good records of all earlier ranges, which are known only
once every range is checked. Reading and parsing are most of the job, so
the pass that checks the ranges does not wait for them: it numbers a range's
good records as if every earlier record were good (`assumed_offsets`), cuts
them at batch boundaries, and folds the stats of the batches within each
range of its bundle into one `FdoStatsFn` accumulator (as a combiner's
lifting would). Once all ranges are checked, the bundle's stats stand if
every range's span (`range_span`: the numbers of its good records in whole
batches) is its span under the true numbering: always when no earlier
record is bad and the last whole batch ends where assumed. Otherwise the
bundle's ranges are read, checked and cut again; a range after a bad record
of its bundle is known to move, so that bundle's stats are not computed at
all. A dataset without bad records is read once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from beam_jobs._batch_stats import BatchStatsComputer
from beam_jobs._batches import (
    RangeOffsets,
    RecordRange,
    SparseRows,
    batch_fragments,
    range_span,
)
from beam_jobs._combiners import FdoStatsFn
from beam_jobs._job_config import FdoJobConfig


class RangeStats(NamedTuple):
    """The stats of ranges under one numbering of the good records.

    Attributes:
      ranges: per range, `(range, good records, span)`: its span under the
        numbering (`range_span`), None where none was computed.
      accumulator: `FdoStatsFn` accumulator of the batches within one range.
      batches: how many batches that is.
      fragments: `(batch, (position of the first row in the batch, rows))` of
        the batches the ranges share with others.
    """

    ranges: list[tuple[RecordRange, int, tuple[int, int] | None]]
    accumulator: Any
    batches: int
    fragments: list[tuple[int, tuple[int, SparseRows]]]


def fdo_stats_fn(config: FdoJobConfig) -> FdoStatsFn:
    """The job's combine of `BatchStats` into `embedding.FdoStats`."""
    return FdoStatsFn(
        geometry=config.geometry,
        config_hash=config.config_hash,
        top_k=config.top_k,
        layout=None if config.fdo_layout is None else config.fdo_layout.entries,
    )


class RangeStatsComputer:
    """Computes `RangeStats` for the ranges of one run."""

    def __init__(self, config: FdoJobConfig):
        self._batch_size = config.geometry.global_batch_size
        self._compute = BatchStatsComputer(config.feature_specs, config.geometry)
        self._fn = fdo_stats_fn(config)

    def empty(self) -> RangeStats:
        """The stats of no range."""
        return RangeStats([], self._fn.create_accumulator(), 0, [])

    def add(
        self, stats: RangeStats, record_range: RecordRange, rows: SparseRows, offsets: RangeOffsets
    ) -> RangeStats:
        """`stats` (used up) and those of `record_range`, of good `rows`, numbered by `offsets`."""
        size = self._batch_size
        span = range_span(offsets, record_range.key, rows.num_rows, size)
        accumulator, whole = stats.accumulator, stats.batches
        for batch, offset, piece in batch_fragments(rows, span[0], size, offsets.total // size):
            if piece.num_rows == size:
                accumulator = self._fn.add_input(accumulator, self._compute(batch, piece))
                whole += 1
            else:
                stats.fragments.append((batch, (offset, piece)))
        stats.ranges.append((record_range, rows.num_rows, span))
        return stats._replace(accumulator=accumulator, batches=whole)

    def without_stats(self, stats: RangeStats, record_range: RecordRange, good: int) -> RangeStats:
        """`stats`' ranges and `record_range` (`good` good records), none of their stats."""
        return self.empty()._replace(ranges=[*stats.ranges, (record_range, good, None)])

    def holds(self, stats: RangeStats, offsets: RangeOffsets) -> bool:
        """Whether `stats` are those of their ranges under `offsets`."""
        return all(
            span == range_span(offsets, r.key, good, self._batch_size)
            for r, good, span in stats.ranges
        )

    def tail(self, stats: RangeStats, offsets: RangeOffsets) -> int:
        """Good records of the ranges in the dropped partial last batch, under `offsets`."""
        spans = [
            (range_span(offsets, r.key, good, self._batch_size), good)
            for r, good, _ in stats.ranges
        ]
        return sum(first + good - stop for (first, stop), good in spans)

    def compact(self, stats: RangeStats) -> RangeStats:
        return stats._replace(accumulator=self._fn.compact(stats.accumulator))
