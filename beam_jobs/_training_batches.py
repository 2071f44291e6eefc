"""The batches training draws (Grain path), formed from record ranges.

Training's order of the records is known before it starts
(`pipelines.batch_plan`): in epoch `e`, position `p` holds record
`order(e, p)` (Grain's global shuffle for the seed, or file order), global
batch `e * K + p // B` takes positions `[j * B, (j + 1) * B)`, and host `h`
its rows `[h * n, (h + 1) * n)`. The job inverts the order: each record of a
range is sent to its batch in every epoch, with its row, and each batch is
put together from the records sent to it.

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
from beam_jobs._batches import RangeCheck, SparseRows, concat_rows, take_rows
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


def batch_parts(
    rows: SparseRows, batches: np.ndarray, keys: np.ndarray, index: np.ndarray
) -> Iterator[tuple[int, tuple[np.ndarray, SparseRows]]]:
    """`(batch, (sort keys, rows))` per batch, from `TrainingBatchPlan.rows` of `rows`."""
    cuts = np.flatnonzero(np.diff(batches)) + 1
    for part in np.split(np.arange(batches.size), cuts):
        if part.size:
            yield int(batches[part[0]]), (keys[part], take_rows(rows, index[part]))


def join_parts(
    batch: int, parts: Iterable[tuple[np.ndarray, SparseRows]], batch_size: int
) -> SparseRows:
    """A batch from its `(sort keys, rows)` parts, in any order: the rows by key.

    Raises:
      ValueError: the parts do not hold `batch_size` rows (a bug or a file
        that changed between the passes).
    """
    parts = list(parts)
    keys = np.concatenate([k for k, _ in parts])
    if keys.size != batch_size:
        raise ValueError(f"Batch {batch}: its records make {keys.size} rows, not {batch_size}.")
    rows = concat_rows([r for _, r in parts])
    return take_rows(rows, np.argsort(keys, kind="stable"))
