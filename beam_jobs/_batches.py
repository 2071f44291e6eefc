"""The run's global batches, formed from record files read in independent ranges.

The batches are those of the training input read in file order, with bad
records skipped (as the online pipeline's `on_bad_record: skip` does): the
good records are numbered in file order, batch `b` is good records
`[b*B, (b+1)*B)`, and the last, partial batch is dropped. Host `h` of `P`
takes rows `[h*B/P, (h+1)*B/P)` of every batch.

A record is bad when the parser rejects it (`pipelines.parse_examples_lenient`:
not an Example, a missing feature, a wrong value type or count, a bad label)
or when it holds an id outside its table's vocabulary or a weight that is
negative or not finite (which the preprocessing would reject for the whole
batch).

To read the files in parallel, each file is cut into ranges of records. A
range's good records start at the number of good records of all earlier
ranges (known once every range is checked); cut at batch boundaries, a range
yields whole batches and, at its two ends, fragments of batches that other
ranges complete. Fragments are joined by batch number in record order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import NamedTuple

import numpy as np
from array_record.python import array_record_module

import pipelines
from beam_jobs._record_urls import is_url, local_copy
from embedding import RaggedIds
from pipelines import DataError

_ARRAY_RECORD_SUFFIX = ".array_record"
_NO_RECORDS = np.zeros(0, np.int64)


class RecordRange(NamedTuple):
    """Records `[start, stop)` of the file at `path`, the `file_index`-th file."""

    file_index: int
    path: str
    start: int
    stop: int

    @property
    def key(self) -> tuple[int, int]:
        """Orders ranges as the records are ordered."""
        return (self.file_index, self.start)


def count_records(path: str) -> int:
    """Records in an ArrayRecord (from its index) or TFRecord (by reading it) file.

    Raises:
      DataError: the file is corrupt or not a record file (named).
    """
    try:
        with local_copy(path) as local:
            if path.endswith(_ARRAY_RECORD_SUFFIX):
                reader = array_record_module.ArrayRecordReader(local)
                try:
                    return reader.num_records()
                finally:
                    reader.close()
            return sum(1 for _ in pipelines.read_records(local))
    except (RuntimeError, DataError) as e:
        raise DataError(f"{path}: cannot count the records of this file: {_reason(e)}") from e


def _reason(error: Exception) -> str:
    """Why the reader failed; `pipelines.read_records` names the file it read
    first, here the local copy of the one the caller names."""
    if isinstance(error, DataError):
        return str(error).split(": ", 1)[-1]
    return str(error)


def split_file(file_index: int, path: str, records_per_range: int) -> list[RecordRange]:
    """The file's records as consecutive ranges of at most `records_per_range`.

    A file named by a URL is one range: every range read fetches the whole file.
    """
    count = count_records(path)
    if is_url(path):
        records_per_range = max(count, 1)
    return [
        RecordRange(file_index, path, start, min(count, start + records_per_range))
        for start in range(0, count, records_per_range)
    ]


def read_range(record_range: RecordRange) -> list[bytes]:
    """The records of a range, in order.

    TFRecord files have no index: a range of one is read from the file's
    start, skipping the earlier records.

    Raises:
      DataError: the file is corrupt or shorter than the range (named).
    """
    path, start, stop = record_range.path, record_range.start, record_range.stop
    try:
        with local_copy(path) as local:
            records = _read_local(local, path.endswith(_ARRAY_RECORD_SUFFIX), start, stop)
    except (RuntimeError, DataError) as e:
        raise DataError(f"{path}: cannot read records [{start}, {stop}): {_reason(e)}") from e
    if len(records) != stop - start:
        raise DataError(
            f"{path}: expected records [{start}, {stop}), read {len(records)}; the file "
            "changed while the job ran."
        )
    return records


def _read_local(path: str, array_record: bool, start: int, stop: int) -> list[bytes]:
    if array_record:
        reader = array_record_module.ArrayRecordReader(path)
        try:
            return list(reader.read(start, stop))
        finally:
            reader.close()
    return list(itertools.islice(pipelines.read_records(path), start, stop))


class SparseRows(NamedTuple):
    """Consecutive rows (examples) of the sparse features.

    Attributes:
      ids: per feature, `int64[nnz]` ids and `int64[rows + 1]` row splits.
      weights: per weighted feature, `float32[nnz]` weights, same row splits.
      dense: `float32[rows, num_dense_features]`, where kept (`check_records`).
    """

    ids: dict[str, RaggedIds]
    weights: dict[str, RaggedIds]
    dense: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return next(iter(self.ids.values())).row_splits.size - 1


def _map_rows(rows: SparseRows, fn) -> SparseRows:
    return SparseRows(
        ids={name: fn(ragged) for name, ragged in rows.ids.items()},
        weights={name: fn(ragged) for name, ragged in rows.weights.items()},
    )


def slice_rows(rows: SparseRows, start: int, stop: int) -> SparseRows:
    """Rows `[start, stop)`."""

    def cut(ragged: RaggedIds) -> RaggedIds:
        splits = ragged.row_splits[start : stop + 1]
        return RaggedIds(ragged.values[splits[0] : splits[-1]], splits - splits[0])

    return _map_rows(rows, cut)


def keep_rows(rows: SparseRows, keep: np.ndarray) -> SparseRows:
    """The rows where `keep` (`bool[rows]`) is true, in order."""
    return take_rows(rows, np.flatnonzero(keep))


def take_rows(rows: SparseRows, indices: np.ndarray) -> SparseRows:
    """The rows at `indices` (`int[k]`, repeats allowed), in that order."""

    def take(ragged: RaggedIds) -> RaggedIds:
        starts = ragged.row_splits[:-1][indices]
        lengths = ragged.row_splits[1:][indices] - starts
        splits = np.zeros(len(indices) + 1, np.int64)
        np.cumsum(lengths, out=splits[1:])
        # Entry i of the output row r is entry starts[r] + i of the input.
        positions = np.arange(splits[-1]) + np.repeat(starts - splits[:-1], lengths)
        return RaggedIds(ragged.values[positions], splits)

    kept = _map_rows(rows, take)
    return kept if rows.dense is None else kept._replace(dense=rows.dense[indices])


def concat_rows(parts: list[SparseRows]) -> SparseRows:
    """The rows of `parts`, one after the other."""

    def join(raggeds: list[RaggedIds]) -> RaggedIds:
        splits, offset = [np.zeros(1, np.int64)], 0
        for ragged in raggeds:
            splits.append(ragged.row_splits[1:] + offset)
            offset += ragged.row_splits[-1]
        return RaggedIds(np.concatenate([r.values for r in raggeds]), np.concatenate(splits))

    first = parts[0]
    return SparseRows(
        ids={name: join([p.ids[name] for p in parts]) for name in first.ids},
        weights={name: join([p.weights[name] for p in parts]) for name in first.weights},
    )


def check_records(
    records: list[bytes],
    layout: pipelines.FeatureLayout,
    vocabulary_sizes: Mapping[str, int],
) -> tuple[SparseRows, list[tuple[int, str]]]:
    """Parses records; separates the good rows from the bad records.

    Args:
      records: serialized `tf.train.Example`s.
      layout: what a record holds.
      vocabulary_sizes: per sparse feature, its table's vocabulary size.

    Returns:
      The good records' rows (in order, with their dense values), and
      `(index in records, reason)` of every bad record, by increasing index.
    """
    parsed, problems = pipelines.parse_examples_lenient(records, layout)
    good = np.setdiff1d(np.arange(len(records)), [i for i, _ in problems])
    rows = SparseRows(ids=parsed.ids, weights=parsed.weights, dense=parsed.dense)
    value_problems = _value_problems(rows, vocabulary_sizes)
    if not value_problems:
        return rows, problems
    keep = np.ones(rows.num_rows, bool)
    keep[list(value_problems)] = False
    problems = problems + [(int(good[row]), reason) for row, reason in value_problems.items()]
    return keep_rows(rows, keep), sorted(problems)


def _value_problems(rows: SparseRows, vocabulary_sizes: Mapping[str, int]) -> dict[int, str]:
    """Per row holding an out-of-vocabulary id or a bad weight, the first such problem."""
    problems: dict[int, str] = {}
    for name, ragged in rows.ids.items():
        size = vocabulary_sizes[name]
        for row, value in _first_bad(ragged, (ragged.values < 0) | (ragged.values >= size)):
            problems.setdefault(
                row,
                f"feature {name!r}: id {value} is outside the vocabulary [0, {size}) of its table",
            )
    for name, ragged in rows.weights.items():
        bad = ~np.isfinite(ragged.values) | (ragged.values < 0)
        for row, value in _first_bad(ragged, bad):
            problems.setdefault(row, f"feature {name!r}: weight {value} is not finite and >= 0")
    return problems


def _first_bad(ragged: RaggedIds, bad: np.ndarray) -> list[tuple[int, object]]:
    """`(row, value)` of the first bad value of every row that has one."""
    if not bad.any():
        return []
    positions = np.flatnonzero(bad)
    rows = np.searchsorted(ragged.row_splits, positions, side="right") - 1
    first_rows, first = np.unique(rows, return_index=True)
    return list(zip(first_rows.tolist(), ragged.values[positions[first]].tolist()))


class RangeCheck(NamedTuple):
    """What checking a range's records learns of it.

    Attributes:
      records: records in the range.
      bad: `int64[k]` the bad records' indices in the range, increasing.
    """

    records: int
    bad: np.ndarray

    @property
    def good(self) -> int:
        return self.records - self.bad.size


class RangeOffsets(NamedTuple):
    """Where each range's good records start in the numbering of all good records.

    Attributes:
      first: per `RecordRange.key`, the number of its first good record.
      total: good records in all ranges.
    """

    first: dict[tuple[int, int], int]
    total: int


def range_offsets(checks: Iterable[tuple[tuple[int, int], RangeCheck]]) -> RangeOffsets:
    """Prefix sums of the good records of `(RecordRange.key, RangeCheck)` pairs, in record order."""
    first, total = {}, 0
    for key, check in sorted(checks, key=lambda pair: pair[0]):
        first[key] = total
        total += check.good
    return RangeOffsets(first, total)


def assumed_offsets(ranges: Iterable[RecordRange]) -> RangeOffsets:
    """The numbering of the good records of `ranges` if all their records were good."""
    return range_offsets((r.key, RangeCheck(r.stop - r.start, _NO_RECORDS)) for r in ranges)


def range_span(
    offsets: RangeOffsets, key: tuple[int, int], good: int, batch_size: int
) -> tuple[int, int]:
    """Numbers `[first, stop)` of a range's good records that whole batches take.

    Args:
      offsets: the numbering of the good records of all ranges.
      key: the range's `RecordRange.key`.
      good: its good records; those numbered `stop` or more fall in the
        dropped partial last batch.
    """
    first = offsets.first[key]
    end = offsets.total // batch_size * batch_size
    return first, max(first, min(first + good, end))


def batch_fragments(
    rows: SparseRows, first_index: int, batch_size: int, num_batches: int
) -> Iterator[tuple[int, int, SparseRows]]:
    """Cuts good rows numbered from `first_index` at batch boundaries.

    Rows numbered `num_batches * batch_size` or more (the partial last batch)
    are left out.

    Yields:
      `(batch number, position of the fragment's first row in the batch,
      rows)`, in order.
    """
    end = min(first_index + rows.num_rows, num_batches * batch_size)
    index = first_index
    while index < end:
        batch, offset = divmod(index, batch_size)
        stop = min(end, (batch + 1) * batch_size)
        yield batch, offset, slice_rows(rows, index - first_index, stop - first_index)
        index = stop


def join_fragments(
    batch: int, fragments: Iterable[tuple[int, SparseRows]], batch_size: int
) -> SparseRows:
    """A batch from its `(position in batch, rows)` fragments, in any order.

    Raises:
      DataError: the fragments do not tile the batch exactly (a bug or a
        file that changed between the passes).
    """
    ordered = sorted(fragments, key=lambda fragment: fragment[0])
    position = 0
    for offset, rows in ordered:
        if offset != position:
            raise DataError(f"Batch {batch}: fragments leave rows [{position}, {offset}) out.")
        position += rows.num_rows
    if position != batch_size:
        raise DataError(f"Batch {batch}: fragments hold {position} rows, not {batch_size}.")
    return concat_rows([rows for _, rows in ordered])


def host_rows(batch: SparseRows, process: int, processes: int) -> SparseRows:
    """Host `process`'s rows of a global batch: `[h*B/P, (h+1)*B/P)`."""
    rows = batch.num_rows // processes
    return slice_rows(batch, process * rows, (process + 1) * rows)
