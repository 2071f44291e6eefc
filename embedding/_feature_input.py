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
      rows: `int64[nnz]` row (sample) of every id, nondecreasing.
      ids: `int64[nnz]` ids, all in `[0, vocabulary_size)`.
      gains: `float32[nnz]` combiner-scaled weights.
      invalid_ids: how many out-of-range ids were dropped.
    """

    rows: np.ndarray
    ids: np.ndarray
    gains: np.ndarray
    invalid_ids: int


def _row_lengths_and_values(leaf, feature: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Returns (`int64[rows]` lengths, `[nnz]` values) of one input leaf."""
    if isinstance(leaf, RaggedIds):
        splits = np.asarray(leaf.row_splits, dtype=np.int64)
        values = np.asarray(leaf.values)
        if splits.ndim != 1 or splits.size == 0 or splits[0] != 0 or splits[-1] != values.size:
            raise ValueError(
                f"Feature {feature!r}: {what} row_splits must start at 0 and end at "
                f"len(values) = {values.size}; got {splits[:3]}...{splits[-1:]}."
            )
        lengths = np.diff(splits)
        if (lengths < 0).any():
            row = int(np.argmax(lengths < 0))
            raise ValueError(f"Feature {feature!r}: {what} row_splits decrease at row {row}.")
        return lengths, values.reshape(-1)
    array = leaf if isinstance(leaf, np.ndarray) else np.asarray(leaf, dtype=object)
    if array.dtype == object:
        if array.ndim != 1:
            raise ValueError(
                f"Feature {feature!r}: ragged {what} must be a 1-D object array of "
                f"1-D arrays, got shape {array.shape}."
            )
        rows = [np.asarray(r).reshape(-1) for r in array]
        lengths = np.fromiter((r.size for r in rows), dtype=np.int64, count=len(rows))
        values = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        if values.dtype == object:
            raise ValueError(f"Feature {feature!r}: {what} rows hold non-numeric values.")
        return lengths, values
    if array.ndim == 1:
        array = array[:, None]
    if array.ndim != 2:
        raise ValueError(
            f"Feature {feature!r}: {what} must be 2-D [rows, valency] or ragged, "
            f"got shape {array.shape}."
        )
    return np.full(array.shape[0], array.shape[1], np.int64), array.reshape(-1)


def _as_int_ids(values: np.ndarray, rows: np.ndarray, feature: str) -> np.ndarray:
    if np.issubdtype(values.dtype, np.integer):
        return values.astype(np.int64, copy=False)
    if values.dtype.kind in "fc" and values.size:
        bad = ~np.isfinite(values) | (values != np.round(values))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"Feature {feature!r}, row {int(rows[i])}: id {values[i]!r} is not an "
                "integer; ids must be integers."
            )
        return values.astype(np.int64)
    if values.size == 0:
        return values.astype(np.int64)
    raise TypeError(f"Feature {feature!r}: ids must be integers, got dtype {values.dtype}.")


def _checked_weights(weights, lengths: np.ndarray, rows: np.ndarray, feature: str) -> np.ndarray:
    if weights is None:
        return np.ones(rows.size, np.float32)
    w_lengths, w = _row_lengths_and_values(weights, feature, "weights")
    if w_lengths.shape != lengths.shape or (w_lengths != lengths).any():
        if w_lengths.shape != lengths.shape:
            detail = f"{w_lengths.size} weight rows for {lengths.size} id rows"
        else:
            row = int(np.argmax(w_lengths != lengths))
            detail = f"row {row} has {w_lengths[row]} weights for {lengths[row]} ids"
        raise ValueError(f"Feature {feature!r}: weights do not match ids ({detail}).")
    try:
        w = w.astype(np.float32)
    except (TypeError, ValueError) as e:
        raise TypeError(f"Feature {feature!r}: weights must be numbers.") from e
    bad = ~np.isfinite(w) | (w < 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"Feature {feature!r}, row {int(rows[i])}: weight {w[i]!r} is not a finite "
            "number >= 0."
        )
    return w


def _gains(weights: np.ndarray, rows: np.ndarray, num_rows: int, combiner: str) -> np.ndarray:
    """`float32[nnz]` gains: weights divided per row as the combiner says."""
    if combiner == "sum":
        return weights
    if combiner == "mean":
        denominator = np.bincount(rows, weights=weights, minlength=num_rows)
    else:
        denominator = np.sqrt(np.bincount(rows, weights=weights * weights, minlength=num_rows))
    denominator = denominator.astype(np.float32)[rows]
    # A row whose weights are all zero contributes nothing (not NaN).
    safe = np.where(denominator > 0, denominator, np.float32(1))
    return np.where(denominator > 0, weights / safe, np.float32(0)).astype(np.float32)


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
      The flat rows, ids and gains; gains are computed before dropping by
      limits, over the ids that are in range.

    Raises:
      ValueError: wrong row count, non-integer or out-of-range ids (policy
        RAISE), NaN/negative/infinite weights, weights not matching ids.
    """
    lengths, values = _row_lengths_and_values(ids, feature, "ids")
    if lengths.size != expected_rows:
        raise ValueError(
            f"Feature {feature!r}: got {lengths.size} rows, expected the host-local "
            f"batch of {expected_rows} (global batch x local devices / global devices)."
        )
    rows = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    values = _as_int_ids(values, rows, feature)
    w = _checked_weights(weights, lengths, rows, feature)
    invalid = (values < 0) | (values >= vocabulary_size)
    num_invalid = int(np.count_nonzero(invalid))
    if num_invalid:
        if invalid_id_policy is not InvalidIdPolicy.DROP:
            i = int(np.argmax(invalid))
            raise ValueError(
                f"Feature {feature!r}, row {int(rows[i])}: id {int(values[i])} is outside "
                f"[0, {vocabulary_size}) ({num_invalid} such ids in this batch). Fix the "
                "data, or set invalid_id_policy='drop' to drop and count them."
            )
        valid = ~invalid
        rows, values, w = rows[valid], values[valid], w[valid]
    return FlatFeature(rows, values, _gains(w, rows, lengths.size, combiner), num_invalid)
