"""Per feature, the distinct ids of a dataset and what the table makes of them.

For `sparseflow stats`: an int64 feature's distinct ids and the fraction of
them outside its table's vocabulary (`[0, vocabulary_size)`: invalid ids,
raised or dropped by `preprocessing.invalid_ids`); a hashed (bytes)
feature's distinct strings and the fraction of them that share a row with
another string after hashing into the vocabulary. Distinct strings are
counted by their full 64-bit fingerprint (`hash_buckets = 2^63 - 1`), whose
own collisions are negligible at any dataset size this runs on.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import pipelines
from sparseflow._text_table import aligned_table

_WIDE_BUCKETS = 2**63 - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureCoverage:
    """One feature's ids over a dataset.

    Attributes:
      name: the feature.
      hashed: whether its ids are hashed strings.
      distinct: distinct ids (for a hashed feature: distinct strings).
      out_of_vocabulary: fraction of the distinct ids outside the vocabulary.
      collisions: fraction of the distinct strings sharing a row with
        another (hashed features only; 0 otherwise).
    """

    name: str
    hashed: bool
    distinct: int
    out_of_vocabulary: float
    collisions: float


class IdCoverage:
    """Accumulates the distinct ids of parsed batches.

    Args:
      layout: the layout the batches are parsed with.
      vocabulary_sizes: per feature, its table's vocabulary size.
    """

    def __init__(self, layout: pipelines.FeatureLayout, vocabulary_sizes: dict[str, int]):
        self._vocabulary_sizes = vocabulary_sizes
        self._hashed = {c.name for c in layout.schema.sparse if c.ids is pipelines.IdType.BYTES}
        # The same records, strings hashed to (practically) unique ids.
        self.wide_layout = (
            pipelines.FeatureLayout.from_schema(
                dataclasses.replace(
                    layout.schema,
                    sparse=tuple(
                        dataclasses.replace(c, hash_buckets=_WIDE_BUCKETS)
                        if c.name in self._hashed
                        else c
                        for c in layout.schema.sparse
                    ),
                )
            )
            if self._hashed
            else None
        )
        self._ids = {name: np.zeros(0, np.int64) for name in layout.sparse}
        self._strings = {name: np.zeros(0, np.int64) for name in self._hashed}

    def add(self, parsed: pipelines.ParsedBatch, wide: pipelines.ParsedBatch | None) -> None:
        """Adds a batch parsed with the layout and (hashed features) with `wide_layout`."""
        for name in self._ids:
            self._ids[name] = np.union1d(self._ids[name], parsed.ids[name].values)
        for name in self._strings:
            self._strings[name] = np.union1d(self._strings[name], wide.ids[name].values)

    def summaries(self) -> tuple[FeatureCoverage, ...]:
        out = []
        for name, ids in self._ids.items():
            hashed = name in self._hashed
            distinct = self._strings[name].size if hashed else ids.size
            outside = np.count_nonzero((ids < 0) | (ids >= self._vocabulary_sizes[name]))
            out.append(
                FeatureCoverage(
                    name=name,
                    hashed=hashed,
                    distinct=distinct,
                    out_of_vocabulary=outside / ids.size if ids.size else 0.0,
                    collisions=1 - ids.size / distinct if hashed and distinct else 0.0,
                )
            )
        return tuple(out)


def format_coverage(features: tuple[FeatureCoverage, ...]) -> list[str]:
    """The per-feature table's lines."""
    rows = [("feature", "ids", "distinct", "out of vocab", "hash collisions")]
    for f in features:
        rows.append(
            (
                f.name,
                "hashed" if f.hashed else "int64",
                f"{f.distinct:,}",
                f"{f.out_of_vocabulary:.2%}",
                f"{f.collisions:.2%}" if f.hashed else "-",
            )
        )
    return aligned_table(rows, "<<>>>")
