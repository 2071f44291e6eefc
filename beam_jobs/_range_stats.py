"""A range's part of the file-order stats: its whole batches folded, its fragments kept.

The batches are those of `beam_jobs._batches`: a range's good records are
numbered from the good records of all earlier ranges, which are known only
once every range is checked. Reading and parsing are most of the job, so
the pass that checks a range does not wait for them: it numbers the range's
good records as if every earlier record were good (`assumed_offsets`), cuts them at
batch boundaries, and folds the stats of its whole batches into one
`FdoStatsFn` accumulator. Once all ranges are checked, that part stands if
its span (`range_span`: the numbers of the good records that whole batches
take) is the span under the true numbering: always when no earlier record is
bad and the last whole batch ends where assumed. A range whose span moved is
read, checked and cut again. A dataset without bad records is read once; one
with bad records, twice from the range after the first bad one on.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from beam_jobs._batch_stats import BatchStatsComputer
from beam_jobs._batches import RangeOffsets, SparseRows, batch_fragments, range_span
from beam_jobs._combiners import FdoStatsFn
from beam_jobs._job_config import FdoJobConfig


class RangeStats(NamedTuple):
    """A range's part of the stats under one numbering of the good records.

    Attributes:
      span: numbers `[first, stop)` of its good records in whole batches.
      good: its good records.
      accumulator: `FdoStatsFn` accumulator (compacted) of the batches
        within it.
      batches: how many batches that is.
      fragments: `(batch, (position of the first row in the batch, rows))`
        of the batches it shares with other ranges.
    """

    span: tuple[int, int]
    good: int
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

    def __call__(self, key: tuple[int, int], rows: SparseRows, offsets: RangeOffsets) -> RangeStats:
        """The stats of range `key` (`RecordRange.key`) of good `rows`, numbered by `offsets`."""
        size = self._batch_size
        span = range_span(offsets, key, rows.num_rows, size)
        accumulator, whole, fragments = self._fn.create_accumulator(), 0, []
        pieces = batch_fragments(rows, span[0], size, offsets.total // size)
        for batch, offset, piece in pieces:
            if piece.num_rows == size:
                accumulator = self._fn.add_input(accumulator, self._compute(batch, piece))
                whole += 1
            else:
                fragments.append((batch, (offset, piece)))
        return RangeStats(span, rows.num_rows, self._fn.compact(accumulator), whole, fragments)
