"""Turning one feature's host-local input into flat, checked (row, id, weight) arrays.

A feature's ids come as a 2-D integer array `[rows, valency]` (every entry is
an id), a 1-D object array of 1-D integer arrays (ragged), or a `RaggedIds`
(flat values plus row splits, what a parser produces without building
per-row arrays). Weights, when given, have the same form and row lengths.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import numpy as np

from embedding._object_rows import flatten as flatten_object_rows


class InvalidIdPolicy(str, enum.Enum):
    """What to do with an id outside `[0, vocabulary_size)`."""

    RAISE = "raise"
    """Raise a `ValueError` naming the feature, row and id."""
    DROP = "drop"
    """Drop the id and count it in `stats.invalid_id_counters`."""


class RaggedIds(NamedTuple):
    """Ragged rows as flat values and row splits (as `tf.RaggedTensor`).

    Attributes:
      values: `int[nnz]` ids (or `float[nnz]` weights) of all rows, in order.
      row_splits: `int[rows + 1]`; row r is `values[row_splits[r]:row_splits[r+1]]`.
    """

    values: np.ndarray
    row_splits: np.ndarray


class FlatFeature(NamedTuple):
    """One feature's checked input, flattened.

    Attributes:
      ids: `int[nnz]` ids, all in `[0, vocabulary_size)`.
      row_splits: `int64[rows + 1]`; row r holds `ids[row_splits[r]:row_splits[r+1]]`.
      gains: `float32[nnz]` combiner-scaled weights, or None when every gain
        is 1 (sum combiner, no weights), which spares building an array of ones.
      invalid_ids: how many out-of-range ids were dropped.
    """

    ids: np.ndarray
    row_splits: np.ndarray
    gains: np.ndarray | None
    invalid_ids: int


def _ragged_leaf(leaf, feature: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Returns (`int64[rows + 1]` row splits, `[nnz]` values) of one input leaf."""
    if isinstance(leaf, RaggedIds):
        splits = np.asarray(leaf.row_splits, dtype=np.int64)
        values = np.asarray(leaf.values).reshape(-1)
        if splits.ndim != 1 or splits.size == 0 or splits[0] != 0 or splits[-1] != values.size:
            raise ValueError(
                f"Feature {feature!r}: {what} row_splits must start at 0 and end at "
                f"len(values) = {values.size}."
            )
        if splits.size > 1 and (np.diff(splits) < 0).any():
            row = int(np.argmax(np.diff(splits) < 0))
            raise ValueError(f"Feature {feature!r}: {what} row_splits decrease at row {row}.")
        return splits, values
    array = leaf if isinstance(leaf, np.ndarray) else np.asarray(leaf, dtype=object)
    if array.dtype == object:
        return _object_rows(array, feature, what)
    if array.ndim == 1:
        array = array[:, None]
    if array.ndim != 2:
        raise ValueError(
            f"Feature {feature!r}: {what} must be 2-D [rows, valency] or ragged, "
            f"got shape {array.shape}."
        )
    rows, valency = array.shape
    return np.arange(rows + 1, dtype=np.int64) * valency, array.reshape(-1)


def _object_rows(array: np.ndarray, feature: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    if array.ndim != 1:
        raise ValueError(
            f"Feature {feature!r}: ragged {what} must be a 1-D object array of 1-D "
            f"arrays, got shape {array.shape}."
        )
    fast = flatten_object_rows(array)
    if fast is not None:
        return fast
    splits = np.zeros(array.size + 1, np.int64)
    if not array.size:
        return splits, np.zeros(0, np.int64)
    try:
        # C-level loops over the rows; a Python loop would cost more than the layout.
        np.cumsum(np.fromiter(map(len, array), np.int64, count=array.size), out=splits[1:])
        values = np.concatenate(array)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"Feature {feature!r}: every row of ragged {what} must be a 1-D array or "
            f"list of numbers ({e})."
        ) from e
    if values.ndim != 1 or values.size != splits[-1] or values.dtype == object:
        raise ValueError(
            f"Feature {feature!r}: every row of ragged {what} must be a 1-D array of numbers."
        )
    return splits, values


def _row_of(splits: np.ndarray, index: int) -> int:
    return int(np.searchsorted(splits, index, side="right") - 1)


def _as_int_ids(values: np.ndarray, splits: np.ndarray, feature: str) -> np.ndarray:
    if np.issubdtype(values.dtype, np.integer):
        return values
    if values.size == 0:
        return values.astype(np.int64)
    if values.dtype.kind == "f":
        bad = ~np.isfinite(values) | (values != np.round(values))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"Feature {feature!r}, row {_row_of(splits, i)}: id {values[i].item()!r} is not "
                "an integer; ids must be integers."
            )
        return values.astype(np.int64)
    raise TypeError(f"Feature {feature!r}: ids must be integers, got dtype {values.dtype}.")


def _checked_weights(weights, splits: np.ndarray, feature: str) -> np.ndarray | None:
    if weights is None:
        return None
    w_splits, w = _ragged_leaf(weights, feature, "weights")
    if w_splits.shape != splits.shape or (w_splits != splits).any():
        if w_splits.shape != splits.shape:
            detail = f"{w_splits.size - 1} weight rows for {splits.size - 1} id rows"
        else:
            row = int(np.argmax(np.diff(w_splits) != np.diff(splits)))
            detail = (
                f"row {row} has {w_splits[row + 1] - w_splits[row]} weights for "
                f"{splits[row + 1] - splits[row]} ids"
            )
        raise ValueError(f"Feature {feature!r}: weights do not match ids ({detail}).")
    try:
        w = w.astype(np.float32)
    except (TypeError, ValueError) as e:
        raise TypeError(f"Feature {feature!r}: weights must be numbers.") from e
    bad = ~np.isfinite(w) | (w < 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"Feature {feature!r}, row {_row_of(splits, i)}: weight {w[i]!r} is not a "
            "finite number >= 0."
        )
    return w


def _gains(weights: np.ndarray | None, splits: np.ndarray, combiner: str) -> np.ndarray | None:
    """`float32[nnz]` gains: weights divided per row as the combiner says."""
    if combiner == "sum":
        return weights
    nnz = int(splits[-1])
    if weights is None:
        weights = np.ones(nnz, np.float32)
    rows = np.repeat(np.arange(splits.size - 1), np.diff(splits))
    if combiner == "mean":
        denominator = np.bincount(rows, weights=weights, minlength=splits.size - 1)
    else:
        denominator = np.sqrt(
            np.bincount(rows, weights=weights * weights, minlength=splits.size - 1)
        )
    denominator = denominator.astype(np.float32)[rows]
    # A row whose weights are all zero contributes nothing (not NaN).
    safe = np.where(denominator > 0, denominator, np.float32(1))
    return np.where(denominator > 0, weights / safe, np.float32(0)).astype(np.float32)


def _drop_invalid(ids, splits, weights, invalid):
    valid = ~invalid
    rows = np.repeat(np.arange(splits.size - 1), np.diff(splits))
    new_splits = np.zeros_like(splits)
    np.cumsum(np.bincount(rows[valid], minlength=splits.size - 1), out=new_splits[1:])
    return ids[valid], new_splits, None if weights is None else weights[valid]


def flatten_feature(
    ids,
    weights,
    *,
    feature: str,
    expected_rows: int,
    vocabulary_size: int,
    combiner: str,
    invalid_id_policy: InvalidIdPolicy,
) -> FlatFeature:
    """Checks one feature's host-local input and flattens it.

    Args:
      ids: the feature's ids (2-D, ragged object array, or `RaggedIds`).
      weights: same form as `ids`, or None for weight 1.
      feature: its name, for error messages.
      expected_rows: host-local batch size the spec implies.
      vocabulary_size: ids must lie in `[0, vocabulary_size)`.
      combiner: "sum", "mean" or "sqrtn".
      invalid_id_policy: raise on out-of-range ids, or drop and count them.

    Returns:
      The flat ids, row splits and gains; gains are computed over the ids that
      are in range, before any dropping by limits.

    Raises:
      ValueError: wrong row count, non-integer or out-of-range ids (policy
        RAISE), NaN/negative/infinite weights, weights not matching ids.
    """
    splits, values = _ragged_leaf(ids, feature, "ids")
    if splits.size - 1 != expected_rows:
        raise ValueError(
            f"Feature {feature!r}: got {splits.size - 1} rows, expected the host-local "
            f"batch of {expected_rows} (global batch x local devices / global devices)."
        )
    values = _as_int_ids(values, splits, feature)
    w = _checked_weights(weights, splits, feature)
    num_invalid = 0
    if values.size and (values.min() < 0 or values.max() >= vocabulary_size):
        invalid = (values < 0) | (values >= vocabulary_size)
        num_invalid = int(np.count_nonzero(invalid))
        if invalid_id_policy is not InvalidIdPolicy.DROP:
            i = int(np.argmax(invalid))
            raise ValueError(
                f"Feature {feature!r}, row {_row_of(splits, i)}: id {int(values[i])} is "
                f"outside [0, {vocabulary_size}) ({num_invalid} such ids in this batch). "
                "Fix the data, or set invalid_id_policy='drop' to drop and count them."
            )
        values, splits, w = _drop_invalid(values, splits, w, invalid)
    return FlatFeature(values, splits, _gains(w, splits, combiner), num_invalid)
