"""CombineFns of the FDO statistics: maxima, exact histograms, id frequencies.

Every accumulator merges associatively and commutatively (maxima, sums of
counts, unions), so the result does not depend on how a runner splits the
input into bundles or in which order it merges the partial results.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

import apache_beam as beam
import numpy as np

import embedding
from beam_jobs._batch_stats import STAT_FIELDS, BatchStats
from embedding.checks import check_int

_PENDING_LIMIT = 64
PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99.9", 99.9), ("max", 100.0))
"""The percentiles of the stats file's `batch_max_percentiles`: (name, q)."""


def _folded(accumulators: Iterable[dict], add: Callable[[dict, dict], Any]) -> dict:
    """The first of `accumulators`, with each of the others added into it by
    `add(merged, accumulator)` (a CombineFn's `merge_accumulators`)."""
    accumulators = iter(accumulators)
    merged = next(accumulators)
    for accumulator in accumulators:
        add(merged, accumulator)
    return merged


class ElementwiseMaxFn(beam.CombineFn):
    """Element-wise maxima of arrays, per key.

    Input: `{key: int[...]}` (every input's array for a key has one shape).
    Output: `{key: int[...]}`, the element-wise maximum over the inputs.
    """

    def create_accumulator(self) -> dict[Hashable, np.ndarray]:
        return {}

    def add_input(self, accumulator, element: Mapping[Hashable, np.ndarray]):
        for key, value in element.items():
            value = np.asarray(value)
            known = accumulator.get(key)
            if known is None:
                accumulator[key] = value.copy()
            elif known.shape != value.shape:
                raise ValueError(
                    f"ElementwiseMaxFn: {key!r} has shape {value.shape}, earlier {known.shape}."
                )
            else:
                np.maximum(known, value, out=known)
        return accumulator

    def merge_accumulators(self, accumulators: Iterable[dict]) -> dict:
        return _folded(accumulators, self.add_input)

    def extract_output(self, accumulator: dict) -> dict[Hashable, np.ndarray]:
        return dict(accumulator)


class IntHistogramFn(beam.CombineFn):
    """Exact histograms of non-negative integers, per key and position.

    Input: `{key: int[K]}`, K values per key (one per partition, say).
    Output: `{key: int64[K, W]}`, `[k, v]` = inputs whose k-th value was v
    (W = the largest value + 1). Exact, so percentiles from it are exact.
    """

    def create_accumulator(self) -> dict[Hashable, np.ndarray]:
        return {}

    def add_input(self, accumulator, element: Mapping[Hashable, np.ndarray]):
        for key, values in element.items():
            values = np.asarray(values, np.int64).reshape(-1)
            if values.size and values.min() < 0:
                raise ValueError(f"IntHistogramFn: {key!r} holds a negative value {values.min()}.")
            counts = _widened(accumulator.get(key), values.size, int(values.max(initial=0)) + 1)
            counts[np.arange(values.size), values] += 1
            accumulator[key] = counts
        return accumulator

    def merge_accumulators(self, accumulators: Iterable[dict]) -> dict:
        return _folded(accumulators, self._add_accumulator)

    def _add_accumulator(self, merged: dict, accumulator: dict) -> None:
        for key, counts in accumulator.items():
            total = _widened(merged.get(key), counts.shape[0], counts.shape[1])
            total[:, : counts.shape[1]] += counts
            merged[key] = total

    def extract_output(self, accumulator: dict) -> dict[Hashable, np.ndarray]:
        return dict(accumulator)


def _widened(counts: np.ndarray | None, rows: int, width: int) -> np.ndarray:
    """`counts` (or zeros) with at least `width` columns."""
    if counts is None:
        return np.zeros((rows, width), np.int64)
    if counts.shape[0] != rows:
        raise ValueError(f"IntHistogramFn: {rows} values per input, earlier {counts.shape[0]}.")
    if counts.shape[1] >= width:
        return counts
    return np.pad(counts, ((0, 0), (0, width - counts.shape[1])))


def histogram_percentiles(counts: np.ndarray) -> dict[str, int]:
    """Nearest-rank percentiles of the values a histogram counts.

    Args:
      counts: `int[W]`, `counts[v]` = how often value v occurred (not all 0).

    Returns:
      {"p50", "p90", "p99", "p99.9", "max"}: the smallest value v with at
      least `q/100 * n` of the `n` values <= v (numpy's "inverted_cdf").
    """
    cumulative = np.cumsum(counts)
    total = int(cumulative[-1])
    if not total:
        raise ValueError("histogram_percentiles: the histogram is empty.")
    return {
        name: int(np.searchsorted(cumulative, _rank(q, total), side="left"))
        for name, q in PERCENTILES
    }


def _rank(q: float, total: int) -> int:
    # ceil(q/100 * n) in exact arithmetic, for q with at most one decimal.
    return max(1, -(-round(q * 10) * total // 1000))


class _IdCounts:
    """Distinct ids and their counts, with inputs not yet folded in."""

    def __init__(self):
        self.ids = np.zeros(0, np.int64)
        self.counts = np.zeros(0, np.int64)
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []

    def compact(self) -> _IdCounts:
        if self.pending:
            ids = np.concatenate([self.ids, *(i for i, _ in self.pending)])
            counts = np.concatenate([self.counts, *(c for _, c in self.pending)])
            self.ids, inverse = np.unique(ids, return_inverse=True)
            self.counts = np.bincount(inverse, weights=counts, minlength=self.ids.size).astype(
                np.int64
            )
            self.pending = []
        return self


class IdFrequencyFn(beam.CombineFn):
    """Exact id counts per table, summarized as distinct ids and heavy hitters.

    Input: `{table: (int64[k] distinct ids, int64[k] counts)}`.
    Output: `{table: embedding.TableIdFrequency}` with the `top_k` most
    frequent ids. Exact: the accumulator holds every distinct id once (as
    many as the vocabulary at most), which fits the tables of one host.
    """

    def __init__(self, top_k: int):
        check_int(top_k, "top_k", 0)
        self._top_k = top_k

    def create_accumulator(self) -> dict[str, _IdCounts]:
        return {}

    def add_input(self, accumulator, element: Mapping[str, tuple[np.ndarray, np.ndarray]]):
        for table, (ids, counts) in element.items():
            entry = accumulator.setdefault(table, _IdCounts())
            entry.pending.append((np.asarray(ids, np.int64), np.asarray(counts, np.int64)))
            if len(entry.pending) >= _PENDING_LIMIT:
                entry.compact()
        return accumulator

    def merge_accumulators(self, accumulators: Iterable[dict]) -> dict:
        return _folded(accumulators, self._add_accumulator)

    def _add_accumulator(self, merged: dict, accumulator: dict) -> None:
        for table, entry in accumulator.items():
            self.add_input(merged, {table: (entry.ids, entry.counts)})
            for ids, counts in entry.pending:
                self.add_input(merged, {table: (ids, counts)})

    def compact(self, accumulator: dict) -> dict:
        for entry in accumulator.values():
            entry.compact()
        return accumulator

    def extract_output(self, accumulator: dict) -> dict[str, embedding.TableIdFrequency]:
        return {table: self._summary(accumulator[table].compact()) for table in sorted(accumulator)}

    def _summary(self, entry: _IdCounts) -> embedding.TableIdFrequency:
        # Most frequent first; among equal counts, the smaller id first.
        order = np.lexsort((entry.ids, -entry.counts))[: self._top_k]
        return embedding.TableIdFrequency(
            ids=int(entry.counts.sum()),
            distinct_ids=int(entry.ids.size),
            top_ids=tuple(zip(entry.ids[order].tolist(), entry.counts[order].tolist())),
        )


class _OnAccumulatorsOf(beam.CombineFn):
    """A CombineFn whose accumulators are `fn`'s: `fn` creates, merges and compacts them."""

    def __init__(self, fn: beam.CombineFn):
        self._fn = fn

    def create_accumulator(self):
        return self._fn.create_accumulator()

    def merge_accumulators(self, accumulators):
        return self._fn.merge_accumulators(accumulators)

    def compact(self, accumulator):
        return self._fn.compact(accumulator)


class PartialCombineFn(_OnAccumulatorsOf):
    """`fn`, stopped short: its output is `fn`'s (compacted) accumulator.

    With `MergeAccumulatorsFn(fn)` it combines separate PCollections without
    flattening their elements: each is combined into one accumulator, and the
    accumulators are merged.
    """

    def add_input(self, accumulator, element):
        return self._fn.add_input(accumulator, element)

    def extract_output(self, accumulator):
        return self._fn.compact(accumulator)


class MergeAccumulatorsFn(_OnAccumulatorsOf):
    """`fn`'s output from accumulators of `fn` (see `PartialCombineFn`)."""

    def add_input(self, accumulator, element):
        return self._fn.merge_accumulators([accumulator, element])

    def extract_output(self, accumulator):
        return self._fn.extract_output(accumulator)


class FdoStatsFn(beam.CombineFn):
    """Per-batch stats -> the run's `embedding.FdoStats`.

    The statistics, each combined by its own CombineFn side by side:
    element-wise maxima per partition (`ElementwiseMaxFn`), exact histograms
    of the batch maxima (for their percentiles) and of the per-partition max
    ids (`IntHistogramFn`), id frequencies (`IdFrequencyFn`), and the batch
    count.

    Input: `BatchStats`. Output: `embedding.FdoStats` (no stacks when there
    were no batches).
    """

    def __init__(
        self,
        *,
        geometry: embedding.FdoGeometry,
        config_hash: str,
        top_k: int,
        layout: Mapping[str, Any] | None = None,
    ):
        self._geometry = geometry
        self._config_hash = config_hash
        self._layout = dict(layout or {})
        self._parts = beam.combiners.TupleCombineFn(
            ElementwiseMaxFn(),
            IntHistogramFn(),
            IntHistogramFn(),
            IdFrequencyFn(top_k),
            beam.combiners.CountCombineFn(),
        )

    def create_accumulator(self):
        return self._parts.create_accumulator()

    def add_input(self, accumulator, element: BatchStats):
        return self._parts.add_input(accumulator, self._split(element))

    def merge_accumulators(self, accumulators):
        return self._parts.merge_accumulators(accumulators)

    def compact(self, accumulator):
        return self._parts.compact(accumulator)

    def extract_output(self, accumulator) -> embedding.FdoStats:
        maxima, batch_maxima, partitions, id_frequency, batches = self._parts.extract_output(
            accumulator
        )
        stacks = {
            name: embedding.StackFdoStats(
                **{field: maxima[name, field] for field in STAT_FIELDS},
                batch_max_percentiles={
                    field: histogram_percentiles(batch_maxima[name, field][0])
                    for field in STAT_FIELDS
                },
                partition_histogram=partitions[name],
            )
            for name in sorted({name for name, _ in maxima})
        }
        return embedding.FdoStats(
            config_hash=self._config_hash,
            geometry=self._geometry,
            batches=batches,
            stacks=stacks,
            tables=id_frequency,
            layout=self._layout,
        )

    def _split(self, batch: BatchStats) -> tuple:
        """The inputs of the parts, in order."""
        partitions = self._geometry.num_partitions
        maxima = {
            (name, field): values
            for name, fields in batch.stacks.items()
            for field, values in fields.items()
        }
        return (
            maxima,
            {key: values.max(keepdims=True) for key, values in maxima.items()},
            {
                name: fields["max_ids_per_partition"].reshape(-1, partitions).max(axis=0)
                for name, fields in batch.stacks.items()
            },
            batch.id_counts,
            batch,
        )
