"""Which rows of which input ranges each output shard holds.

Shard s of N holds rows `[s * T // N, (s + 1) * T // N)` of the T rows of
all ranges in file order: contiguous, and the shards' sizes within one of
each other. A shard's rows are pieces of the ranges that hold them, each
with the line number of its first row.
"""

from __future__ import annotations

import dataclasses
import itertools

from beam_jobs._import_sources import InputRange


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows `[skip, skip + take)` of a range, the first of them on line `first_line`."""

    input_range: InputRange
    skip: int
    take: int
    first_line: int


def plan_shards(
    counts: list[tuple[tuple[int, int], int]],
    ranges: list[InputRange],
    shards: int,
    header: bool,
) -> list[tuple[int, list[Piece]]]:
    """Per shard, the pieces of ranges holding its rows (contiguous, sizes within 1).

    Args:
      counts: `(range key, rows)` of every range, in any order.
      ranges: every range, in file order.
    """
    rows = dict(counts)
    ends = list(itertools.accumulate(rows[r.key] for r in ranges))
    total = ends[-1] if ends else 0
    bounds = [s * total // shards for s in range(shards + 1)]
    plans = []
    for s in range(shards):
        lo, hi = bounds[s], bounds[s + 1]
        pieces = []
        before_in_file = 0
        for i, r in enumerate(ranges):
            if r.index == 0:
                before_in_file = 0
            start = ends[i] - rows[r.key]
            skip, stop = max(lo, start) - start, min(hi, ends[i]) - start
            if skip < stop:
                first_line = 1 + int(header) + before_in_file + skip
                pieces.append(Piece(r, skip, stop - skip, first_line))
            before_in_file += rows[r.key]
        plans.append((s, pieces))
    return plans
