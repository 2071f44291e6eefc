"""`embedding.dense_lookup` against a float64 numpy reference of the combiners."""

from __future__ import annotations

import numpy as np
import pytest

import embedding


def _reference(table, rows: list[list[int]], weights: list[list[float]], combiner: str):
    out = np.zeros((len(rows), table.shape[1]))
    for r, (ids, w) in enumerate(zip(rows, weights, strict=True)):
        w = np.asarray(w, np.float64)
        denominator = {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}[combiner]
        if denominator > 0:
            out[r] = (w[:, None] * table[ids]).sum(0) / denominator
    return out


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_padded_rows_combine_as_the_reference(combiner):
    rng = np.random.default_rng(0)
    table = rng.normal(size=(50, 4)).astype(np.float32)
    rows = [[3, 7, 7], [0], [49, 1], []]
    weights = [[0.5, 2.0, 1.0], [3.0], [1.0, 0.0], []]
    length = 3
    ids = np.array([r + [0] * (length - len(r)) for r in rows], np.int32)
    padded = np.array([w + [0.0] * (length - len(w)) for w in weights], np.float32)
    out = embedding.dense_lookup(table, ids, padded, combiner)
    expected = _reference(table.astype(np.float64), rows, weights, combiner)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=1e-6)
    assert not np.asarray(out)[3].any()  # a row without ids gives zeros, not NaN


def test_an_unknown_combiner_is_refused_by_name():
    with pytest.raises(ValueError, match="'max'"):
        embedding.dense_lookup(np.zeros((2, 2), np.float32), np.zeros((1, 1), np.int32),
                               np.ones((1, 1), np.float32), "max")  # fmt: skip
