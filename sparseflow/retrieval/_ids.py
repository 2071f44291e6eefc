"""Ids given per row: one id each (`int[n]`), or a list of ids each (ragged)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike


class RowIds(NamedTuple):
    """`values: int64[nnz]` and `row_splits: int64[n + 1]`: row r's ids are
    `values[row_splits[r]:row_splits[r + 1]]`."""

    values: np.ndarray
    row_splits: np.ndarray

    @property
    def rows(self) -> int:
        return len(self.row_splits) - 1

    def row(self, r: int) -> np.ndarray:
        return self.values[self.row_splits[r] : self.row_splits[r + 1]]


def row_ids(ids: ArrayLike, name: str) -> RowIds:
    """`ids` as `RowIds`: an `int[n]` array (one id a row) or n sequences of ids.

    Raises:
      ValueError: `ids` is neither (a float array, a 2-D array, nested lists).
    """
    if isinstance(ids, np.ndarray) and ids.dtype != object:
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"{name} must be int[n] (one id a row) or n lists of ids, got "
                f"{ids.dtype}{list(ids.shape)}."
            )
        return RowIds(ids.astype(np.int64), np.arange(len(ids) + 1, dtype=np.int64))
    rows = [np.atleast_1d(np.asarray(row)) for row in ids]
    if any(
        row.ndim != 1 or (row.size and not np.issubdtype(row.dtype, np.integer)) for row in rows
    ):
        raise ValueError(f"{name} must be int[n] (one id a row) or n lists of int ids.")
    lengths = np.array([row.size for row in rows], np.int64)
    values = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)
    return RowIds(values, np.concatenate([[0], np.cumsum(lengths)]))
