"""The batches training draws (Grain path), formed from record ranges.

Training's order of the records is known before it starts
(`pipelines.batch_plan`): in epoch `e`, position `p` holds record
`order(e, p)` (Grain's global shuffle for the seed, or file order), global
batch `e * K + p // B` takes positions `[j * B, (j + 1) * B)`, and host `h`
its rows `[h * n, (h + 1) * n)`. The job inverts the order: each record of a
range is sent to its batch in every epoch, with its row, and each batch is
put together from the records sent to it. Records travel by groups of
consecutive batches (`batches_per_group`): one element per range and group,
not per range and batch.

A bad record (one `check_records` rejects) leaves its row empty; training
fills the host's share of the batch with the first good records that follow
the share in its epoch (`pipelines._preprocess_stage`), after the share's
good rows. The bad records are few and known after the first pass, so the
fill-ins are found there, once (`TrainingBatchPlan`), and each fill-in
record is sent to the batch it fills too.

Rows are ordered by a sort key: `(host * 2 + kind) * B + index`, kind 0 for
a record at its own row (index: its row), 1 for a fill-in (index: its place
among the share's fill-ins).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

import embedding
import pipelines
from beam_jobs._batches import RangeCheck, SparseRows, concat_rows, slice_rows, take_rows
from beam_jobs._job_config import TrainingOrder


class TrainingBatchPlan:
    """Where training puts every record, from the first pass over the ranges.

    Args:
      order: training's order (seed, epochs).
      geometry: global batch and hosts.
      checks: `(RecordRange.key, RangeCheck)` of every range of the dataset.

    Fewer records than one global batch make no batch (the job then writes
    no stats and says so).

    Raises:
      ValueError: a host's share of an epoch with too few good records to
        fill a batch (as training would).
    """

    def __init__(
        self,
        order: TrainingOrder,
        geometry: embedding.FdoGeometry,
        checks: Iterable[tuple[tuple[int, int], RangeCheck]],
    ):
        checks = sorted(checks, key=lambda pair: pair[0])
        self.first_record: dict[tuple[int, int], int] = {}
        total, bad = 0, []
        for key, check in checks:
            self.first_record[key] = total
            bad.append(check.bad + total)
            total += check.records
        self.batch_order = embedding.FdoBatchOrder(
            records=total, shuffle_seed=order.shuffle_seed, epochs=order.epochs
        )
        self._batch_size = geometry.global_batch_size
        self._host_rows = geometry.global_batch_size // geometry.processes
        hosts = range(geometry.processes if total >= geometry.global_batch_size else 0)
        self._plans = [
            pipelines.batch_plan(
                total,
                pipelines.BatchingConfig(
                    global_batch_size=geometry.global_batch_size,
                    process_index=host,
                    process_count=geometry.processes,
                    num_epochs=order.epochs,
                    shuffle_seed=order.shuffle_seed,
                ),
            )
            for host in hosts
        ]
        self._bad = np.concatenate(bad) if bad else np.zeros(0, np.int64)
        self._fill_records, self._fill_batches, self._fill_keys = self._fill_ins()

    def _batch_rows(self, records: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self._plans:
            return (np.zeros(0, np.int64),) * 3
        return self._plans[0].batch_rows(records)

    def _fill_ins(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`(record, batch, sort key)` of every fill-in, sorted by record."""
        batches, rows, _ = self._batch_rows(self._bad)
        hosts = rows // self._host_rows
        shares, counts = np.unique(np.stack([batches, hosts], axis=1), axis=0, return_counts=True)
        found = np.zeros((0, 3), np.int64)
        for (batch, host), count in zip(shares.tolist(), counts.tolist(), strict=True):
            records = self._first_good_after(batch, host, count)
            keys = (host * 2 + 1) * self._batch_size + np.arange(count)
            found = np.concatenate([found, np.stack([records, np.full(count, batch), keys], 1)])
        records, batches, keys = found.T
        order = np.argsort(records, kind="stable")
        return records[order], batches[order], keys[order]

    def _first_good_after(self, batch: int, host: int, count: int) -> list[int]:
        """The first `count` good records after `host`'s share of `batch` in its epoch."""
        found: list[int] = []
        for records in self._plans[host].following_record_indices(batch):
            found += records[~np.isin(records, self._bad)][: count - len(found)].tolist()
            if len(found) == count:
                return found
        raise ValueError(
            f"Batch {batch} (host {host}): this host's share of the epoch holds too few good "
            f"records to replace its {count} bad ones; the dataset is mostly bad records."
        )

    def rows(self, records: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Where good `records` (`int64[k]`, dataset indices) go.

        Returns:
          `(batch, sort key, index into records)`, each `int64[m]`, sorted by
          batch; and how many (record, epoch) pairs fell in an epoch's dropped
          tail.
        """
        batches, rows, index = self._batch_rows(records)
        keys = (rows // self._host_rows * 2) * self._batch_size + rows
        tail = records.size * self.batch_order.epochs - index.size
        # The fill-ins of records[i] are entries [start[i], start[i] + count[i]).
        start = np.searchsorted(self._fill_records, records, side="left")
        count = np.searchsorted(self._fill_records, records, side="right") - start
        fills = np.repeat(np.arange(records.size), count)
        before = np.cumsum(count) - count
        at = np.arange(fills.size) + np.repeat(start - before, count)
        batches = np.concatenate([batches, self._fill_batches[at]])
        keys = np.concatenate([keys, self._fill_keys[at]])
        index = np.concatenate([index, fills])
        order = np.lexsort((keys, batches))
        return batches[order], keys[order], index[order], int(tail)


def batches_per_group(records_per_range: int, batch_size: int) -> int:
    """Consecutive batches sent to one group: about a range's worth of rows.

    A record range's rows spread over every batch of a shuffled run; sent
    per batch, they would make a small element per (range, batch) pair,
    each costing its own selection, pickling and join. Sent per group of
    batches, a range makes one element per group, and a group's batches
    are put together with one sort.
    """
    return max(1, records_per_range // batch_size)


def group_parts(
    rows: SparseRows, batches: np.ndarray, keys: np.ndarray, index: np.ndarray, group_size: int
) -> Iterator[tuple[int, tuple[np.ndarray, np.ndarray, SparseRows]]]:
    """`(group, (batches, sort keys, rows))` per group of `group_size` consecutive batches.

    Args:
      rows: a range's good rows.
      batches, keys, index: `TrainingBatchPlan.rows` of them (sorted by batch).
      group_size: batches per group (`batches_per_group`).
    """
    sparse = rows._replace(dense=None)
    groups = batches // group_size
    cuts = np.flatnonzero(np.diff(groups)) + 1
    for start, stop in zip([0, *cuts], [*cuts, groups.size], strict=True):
        if stop > start:
            part = slice(start, stop)
            # Dense values are no stat's input: left behind, not pickled.
            yield int(groups[start]), (batches[part], keys[part], take_rows(sparse, index[part]))


def join_group(
    group: int, parts: Iterable[tuple[np.ndarray, np.ndarray, SparseRows]], batch_size: int
) -> Iterator[tuple[int, SparseRows]]:
    """`(batch, rows)` of a group's batches, from its parts in any order: rows by sort key.

    Raises:
      ValueError: a batch does not get `batch_size` rows (a bug or a file
        that changed between the passes).
    """
    parts = list(parts)
    batches = np.concatenate([b for b, _, _ in parts])
    keys = np.concatenate([k for _, k, _ in parts])
    numbers, counts = np.unique(batches, return_counts=True)
    wrong = np.flatnonzero(counts != batch_size)
    if wrong.size:
        batch, count = numbers[wrong[0]], counts[wrong[0]]
        raise ValueError(f"Batch {batch}: its records make {count} rows, not {batch_size}.")
    rows = take_rows(concat_rows([r for _, _, r in parts]), np.lexsort((keys, batches)))
    for i, batch in enumerate(numbers.tolist()):
        yield batch, slice_rows(rows, i * batch_size, (i + 1) * batch_size)
