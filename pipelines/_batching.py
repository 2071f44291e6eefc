"""Which records form which batch on which host; shared by the Grain and tf.data paths.

A dataset of `R` records is read in epochs. In epoch `e`, an order maps the
epoch's positions `0..R-1` to record indices (the identity, or a seeded
permutation that differs per epoch). Global batch `b` (epoch `e = b // K`,
`j = b mod K`, `K = R // B` batches per epoch of global size `B`) holds the
records at positions `[j * B, (j + 1) * B)`, and host `p` of `P` takes rows
`[p * n, (p + 1) * n)` of it, `n = B / P`. So:

* batches line up across hosts: batch `b` is the same `B` records on every
  host, each host preparing its own `n` rows;
* every host runs exactly `E * K` batches (`E` epochs), a number each host
  computes from the dataset size alone, so all hosts stop at the same step;
* the last `R mod B` positions of every epoch (the tail that does not fill a
  global batch) are dropped; with a shuffled order they are different records
  in every epoch.

Bad records (when skipped) are replaced inside their batch by the good records
that follow the batch's rows in the host's share of the same epoch: the host's
rows of batches `j + 1, j + 2, ...`, wrapping to the epoch's first batch. Such
a fill-in also stays in its own batch (it is used twice in the epoch), so a
batch depends on its own index only: host alignment, the batch count and the
Grain worker assignment are the same with or without bad records.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np

from embedding.checks import check_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchingConfig:
    """How records are ordered, batched and shared among hosts.

    Attributes:
      global_batch_size: B, records per global batch (all hosts together).
      process_index: p, this host's index (`jax.process_index()` under
        `jax.distributed`).
      process_count: P, hosts reading the dataset; must divide B.
      num_epochs: E, passes over the dataset.
      shuffle_seed: seed of the per-epoch global shuffle, in [0, 2**32); None
        reads the records in file order. Every host must use the same seed.
    """

    global_batch_size: int
    process_index: int = 0
    process_count: int = 1
    num_epochs: int = 1
    shuffle_seed: int | None = None

    def __post_init__(self):
        check_int(self.global_batch_size, "global_batch_size", 1)
        check_int(self.process_count, "process_count", 1)
        check_int(self.process_index, "process_index", 0)
        check_int(self.num_epochs, "num_epochs", 1)
        if self.process_index >= self.process_count:
            raise ValueError(
                f"process_index {self.process_index} is not below process_count "
                f"{self.process_count}."
            )
        if self.global_batch_size % self.process_count:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} does not split over "
                f"{self.process_count} hosts; use a multiple of {self.process_count}."
            )
        seed = self.shuffle_seed
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32
        ):
            raise ValueError(
                f"shuffle_seed must be None or an integer in [0, 2**32), got {seed!r}."
            )

    @property
    def host_batch_size(self) -> int:
        """n, the rows of a global batch one host prepares."""
        return self.global_batch_size // self.process_count


class EpochOrder(Protocol):
    """Maps positions of an epoch to record indices (a permutation per epoch)."""

    def __call__(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """`int64[k]` the record indices at `positions` (`int64[k]`) of `epoch`."""

    def positions(self, epoch: int, records: np.ndarray) -> np.ndarray:
        """`int64[k]` the positions of `records` (`int64[k]`) in `epoch`: the inverse."""


class FileOrder:
    """The records in file order, the same in every epoch."""

    def __call__(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        del epoch
        return np.asarray(positions, np.int64)

    def positions(self, epoch: int, records: np.ndarray) -> np.ndarray:
        return self(epoch, records)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """The batches of one host over a dataset of `num_records` records.

    Attributes:
      config: ordering, batch size and hosts.
      num_records: R, records in the dataset.
      order: the per-epoch order of the records.
    """

    config: BatchingConfig
    num_records: int
    order: EpochOrder = dataclasses.field(default_factory=FileOrder)

    def __post_init__(self):
        check_int(self.num_records, "num_records", 0)
        if self.num_records < self.config.global_batch_size:
            raise ValueError(
                f"The dataset holds {self.num_records} records, fewer than one global "
                f"batch of {self.config.global_batch_size}; add records or lower "
                "global_batch_size."
            )

    @property
    def batches_per_epoch(self) -> int:
        """K = R // B, full global batches per epoch."""
        return self.num_records // self.config.global_batch_size

    @property
    def num_batches(self) -> int:
        """E * K, the batches every host runs."""
        return self.config.num_epochs * self.batches_per_epoch

    @property
    def dropped_per_epoch(self) -> int:
        """R mod B, the positions of every epoch left out (the last ones)."""
        return self.num_records % self.config.global_batch_size

    def _positions(self, index_in_epoch: int) -> np.ndarray:
        config = self.config
        start = index_in_epoch * config.global_batch_size
        start += config.process_index * config.host_batch_size
        return np.arange(start, start + config.host_batch_size, dtype=np.int64)

    def _check_batch(self, batch: int) -> None:
        if not 0 <= batch < self.num_batches:
            raise IndexError(f"Batch {batch} is outside [0, {self.num_batches}).")

    def record_indices(self, batch: int) -> np.ndarray:
        """`int64[n]` the records of this host's rows of global batch `batch`."""
        self._check_batch(batch)
        epoch, index_in_epoch = divmod(batch, self.batches_per_epoch)
        return self.order(epoch, self._positions(index_in_epoch))

    def batch_rows(self, records: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where `records` (`int64[k]`) go in every epoch: the inverse of `record_indices`.

        Returns:
          `(batch, row, index)`, each `int64[m]`: record `records[index]`
          is row `row` (of all hosts' `B`) of global batch `batch`; records
          in an epoch's dropped tail are left out. Ordered by epoch, then as
          `records`.
        """
        records = np.asarray(records, np.int64)
        size, per_epoch = self.config.global_batch_size, self.batches_per_epoch
        found = []
        for epoch in range(self.config.num_epochs):
            positions = self.order.positions(epoch, records)
            kept = np.flatnonzero(positions < per_epoch * size)
            batch, row = np.divmod(positions[kept], size)
            found.append((batch + epoch * per_epoch, row, kept))
        return tuple(np.concatenate(parts) for parts in zip(*found, strict=True))

    def following_record_indices(self, batch: int) -> Iterator[np.ndarray]:
        """The records after `batch`'s rows in this host's share of its epoch.

        Yields the host's rows of the epoch's next batches, one `int64[n]`
        array per batch, wrapping to the epoch's first batch and stopping
        before `batch` comes round again.
        """
        self._check_batch(batch)
        epoch, index_in_epoch = divmod(batch, self.batches_per_epoch)
        count = self.batches_per_epoch
        for step in range(1, count):
            yield self.order(epoch, self._positions((index_in_epoch + step) % count))


@dataclasses.dataclass(frozen=True)
class RecordFiles:
    """Record files and their record counts, for naming a record's place.

    Attributes:
      paths: the files, in dataset order.
      counts: records per file.
    """

    paths: tuple[str, ...]
    counts: tuple[int, ...]

    def __post_init__(self):
        if len(self.paths) != len(self.counts):
            raise ValueError(f"{len(self.paths)} paths but {len(self.counts)} counts.")

    @property
    def num_records(self) -> int:
        return sum(self.counts)

    def describe(self, record_index: int) -> str:
        """E.g. `record 7 of data/part-00001.tfrecord (dataset record 1031)`."""
        ends = list(itertools.accumulate(self.counts))
        file_index = bisect.bisect_right(ends, record_index)
        if file_index == len(ends):
            return f"dataset record {record_index} (past the last file's end)"
        start = ends[file_index] - self.counts[file_index]
        return (
            f"record {record_index - start} of {self.paths[file_index]} "
            f"(dataset record {record_index})"
        )


class RecordReader(Protocol):
    """Random access to the records of a dataset, for the preprocessing stage."""

    @property
    def files(self) -> RecordFiles:
        """The files read, with their record counts."""

    def read(self, record_indices: Sequence[int]) -> Sequence[bytes]:
        """The records at `record_indices`, in that order (a list, or a `RecordBatch`)."""
