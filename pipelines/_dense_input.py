"""A parsed batch's dense input: every dense key of a `RecordSchema` at once.

A schema of scalar dense keys (Criteo's 13 counts) has a key per value; a
few numpy calls per key and batch, to count, check, fill defaults and
transform, cost more than parsing the key. `DenseKeys` does each step for
all keys together, on the `(values, row_splits)` per key that both record
parsers give.
"""

from __future__ import annotations

import functools

import numpy as np

from pipelines._schema import DenseTransform, RecordSchema


class DenseKeys:
    """The dense keys of one schema, in the order of the dense input.

    Attributes:
      keys: the record keys.
      lengths: `int64[keys]`, values per record of each key.
    """

    def __init__(self, schema: RecordSchema):
        columns = schema.dense
        self.keys = [c.key for c in columns]
        self.lengths = np.array([c.length for c in columns], np.int64)
        self._required = np.array([c.default is None for c in columns], bool)
        # Per value of the dense input: its default (0 where there is none:
        # every record then holds the key) and transform.
        self._defaults = np.repeat(
            np.array([c.default or 0 for c in columns], np.float32), self.lengths
        )
        transforms = [c.transform for c in columns for _ in range(c.length)]
        self._log1p = _where(transforms, DenseTransform.LOG1P)
        self._standardized = _where(transforms, DenseTransform.STANDARDIZE)
        standardized = schema.standardized()
        self._mean = np.array([m for c in standardized for m in c.mean or ()], np.float32)
        self._std = np.array([s for c in standardized for s in c.std or ()], np.float32)

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def of(schema: RecordSchema) -> DenseKeys:
        """The (cached) `DenseKeys` of `schema`."""
        return DenseKeys(schema)

    def counts(self, parsed: dict[str, tuple], batch: int) -> np.ndarray:
        """`int64[keys, batch]`: values per record of each key."""
        if not self.keys:
            return np.zeros((0, batch), np.int64)
        return np.diff(np.stack([parsed[key][1] for key in self.keys]), axis=1)

    def miscounted(self, counts: np.ndarray) -> np.ndarray:
        """`bool[batch]`: records holding a key with a wrong count of values (none is
        right for a key with a default)."""
        lengths = self.lengths[:, None]
        wrong = (counts != lengths) & ((counts != 0) | self._required[:, None])
        return wrong.any(axis=0)

    def values(self, parsed: dict[str, tuple], counts: np.ndarray) -> np.ndarray:
        """`float32[batch, num_dense_features]`: defaults filled in, transforms applied.

        Every record holds each key with its `length` values, or none when the
        key has a default (`miscounted` is False everywhere).
        """
        batch = counts.shape[1]
        if not self.keys:
            return np.zeros((batch, 0), np.float32)
        # Int values become float32 as they are copied in (as `astype` casts them).
        columns = [parsed[key][0] for key in self.keys]
        present = counts != 0
        if present.all():
            out = np.concatenate(
                [c.reshape(batch, n) for c, n in zip(columns, self.lengths, strict=True)],
                axis=1,
                dtype=np.float32,
                casting="unsafe",
            )
        else:
            out = np.tile(self._defaults, (batch, 1))
            start = 0
            for column, length, rows in zip(columns, self.lengths, present, strict=True):
                out[rows, start : start + length] = column.reshape(-1, length)
                start += length
        if self._log1p is not None:
            values = out[:, self._log1p]
            np.log1p(np.maximum(values, np.float32(0), out=values), out=values)
            if not isinstance(self._log1p, slice):  # a copy, not a view of `out`
                out[:, self._log1p] = values
        if self._standardized is not None:
            out[:, self._standardized] = (out[:, self._standardized] - self._mean) / self._std
        return out


def _where(
    transforms: list[DenseTransform], transform: DenseTransform
) -> slice | np.ndarray | None:
    """The dense input's columns of `transform`: None, all (a slice, which
    indexes without copying), or their indices."""
    columns = [i for i, t in enumerate(transforms) if t is transform]
    if not columns:
        return None
    if len(columns) == len(transforms):
        return slice(None)
    return np.array(columns, np.int64)
