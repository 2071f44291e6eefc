"""Which batches FDO stats cover: the ones a shuffled (or file-order) run draws.

A run's batches are known before it starts: with `R` records, global batch
`B` and a shuffle seed, epoch `e` puts the records in Grain's global shuffle
order for `seed + e` (or in file order without a seed), and batch `b` of the
run is the same `B` records whatever the epoch count (`pipelines._batching`).
Stats computed over exactly these batches bound every batch of such a run:
its limits need no margin for the batches the stats did not see.
"""

from __future__ import annotations

import dataclasses

from embedding._specs import check_positive_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class FdoBatchOrder:
    """The batches stats were computed over: those of a run on `records` records.

    Attributes:
      records: R, records of the dataset (good and bad, as the input counts them).
      shuffle_seed: the run's shuffle seed, or None for file order.
      epochs: passes over the dataset the stats cover.
    """

    records: int
    shuffle_seed: int | None
    epochs: int

    def __post_init__(self) -> None:
        check_positive_int(self.records, "FdoBatchOrder.records")
        check_positive_int(self.epochs, "FdoBatchOrder.epochs")
        seed = self.shuffle_seed
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32
        ):
            raise ValueError(
                "FdoBatchOrder.shuffle_seed must be None or an integer in [0, 2**32), "
                f"got {seed!r}."
            )

    def covers(self, run: FdoBatchOrder) -> bool:
        """Whether every batch of `run` (same geometry) is one of these batches."""
        return (
            self.records == run.records
            and self.shuffle_seed == run.shuffle_seed
            and self.epochs >= run.epochs
        )
