"""The lookup benchmark's shape and optimizer settings, shared by its driver and
the processes that time a step. Standard library only (the TorchRec peer
reads it from its own environment).
"""

from __future__ import annotations

import dataclasses
import json

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
# Optimizers the TorchRec peer does not run on a CPU (jax-tpu-embedding's
# other optimizers, and Adam and row-wise Adam, which FBGEMM builds for GPUs
# only):
# ours alone, timed against our own SGD step.
OURS_ONLY_OPTIMIZERS = ("laprop", "adagrad_momentum", "f2a", "rowwise_adam", "adam")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LookupShape:
    """One table per feature, `tables` features, sum combiner.

    Attributes:
      tables: the number of tables (feature `f<t>` reads table `t<t>`).
      vocabulary: rows per table.
      dim: the embedding dimension.
      batch: the global batch (samples per step).
      max_valency: each sample has 1..max_valency ids.
      zipf: ids are `(Zipf(zipf) - 1) mod vocabulary`.
      learning_rate: of every optimizer.
      initial_accumulator: Adagrad's and row-wise Adagrad's starting accumulator.
      epsilon: added to the accumulator's root by row-wise Adagrad (both sides)
        and by TorchRec's Adagrad (ours has none; next to the root of the
        initial accumulator it is nothing).
    """

    tables: int
    vocabulary: int
    dim: int
    batch: int
    max_valency: int = 20
    zipf: float = 1.1
    learning_rate: float = 0.05
    initial_accumulator: float = 0.1
    epsilon: float = 1e-8

    def __post_init__(self) -> None:
        for name in ("tables", "vocabulary", "dim", "batch", "max_valency"):
            if getattr(self, name) < 1:
                raise ValueError(f"LookupShape: {name} must be >= 1, got {getattr(self, name)!r}")
        if self.batch % 8:
            raise ValueError(f"LookupShape: batch must split over 8 devices, got {self.batch}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LookupShape:
        return cls(**json.loads(text))


FULL = LookupShape(tables=8, vocabulary=1_000_000, dim=16, batch=4096)
"""The measured shape: about 344k ids and 158k distinct ids per step."""

SMALL = LookupShape(tables=8, vocabulary=20_000, dim=16, batch=512)
"""For checking that the benchmark runs (`--small`); its figures mean little."""
