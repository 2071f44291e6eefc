"""The layout's radix sort against numpy's sort (the library path it replaces).

`stable_sort_by_bits` orders only the key fields its callers cannot already
have in order; on real stacks, with several features, devices, duplicates
and minibatches, its result must equal `np.sort` of the whole keys.
"""

from __future__ import annotations

import numpy as np
import pytest

import embedding
from embedding import _layout
from embedding._layout_kernel import stable_sort_by_bits


@pytest.mark.parametrize(
    "n,low,high",
    [(0, 0, 20), (1, 3, 9), (1000, 0, 13), (5000, 4, 30), (5000, 10, 50), (300, 7, 7)],
)
def test_sorts_stably_by_the_field(n, low, high):
    rng = np.random.default_rng(n + low + high)
    # Few distinct field values: many ties, whose input order must be kept.
    field = rng.integers(0, min(1 << (high - low), 40), n) if high > low else np.zeros(n, int)
    keys = (field.astype(np.int64) << low) | rng.integers(0, 1 << low, n)
    want = keys[np.argsort(keys >> low, kind="stable")]
    np.testing.assert_array_equal(stable_sort_by_bits(keys.copy(), low, high), want)


def test_a_field_all_keys_share_is_skipped_and_still_sorted():
    keys = (np.int64(5) << 40) | np.arange(100, 0, -1, dtype=np.int64) << 20
    np.testing.assert_array_equal(stable_sort_by_bits(keys.copy(), 20, 43), np.sort(keys))


def _specs(batch: int, max_ids: int, max_unique: int) -> dict:
    table = embedding.TableSpec(
        name="t",
        vocabulary_size=3000,
        embedding_dim=8,
        combiner="sum",
        initializer=embedding.initializers.Constant(0.0),
        optimizer=embedding.SGDOptimizerSpec(),
        max_ids_per_partition=max_ids,
        max_unique_ids_per_partition=max_unique,
    )
    return {
        name: embedding.FeatureSpec(
            name=name, table_spec=table, input_shape=[batch, 6], output_shape=[batch, 8]
        )
        for name in "abc"
    }


@pytest.mark.parametrize("minibatching", [False, True])
@pytest.mark.parametrize("local,global_,slots", [(1, 1, 1), (2, 2, 2), (2, 4, 4)])
def test_stack_keys_equal_numpy_sort_of_whole_keys(
    monkeypatch, local, global_, slots, minibatching
):
    calls = []

    def recording(keys, low, high):
        given = keys.copy()
        out = stable_sort_by_bits(keys, low, high)
        calls.append((given, out.copy()))
        return out

    monkeypatch.setattr(_layout, "stable_sort_by_bits", recording)
    rng = np.random.default_rng(local + global_ + slots)
    batch = 16 * global_ * slots
    rows = batch * local // global_
    features = {}
    for name in "abc":
        lengths = rng.integers(0, 7, rows)
        # Zipf ids: duplicates within and across rows and features.
        values = (rng.zipf(1.3, lengths.sum()) - 1) % 3000
        features[name] = embedding.RaggedIds(values, np.concatenate([[0], np.cumsum(lengths)]))
    limits = (6, 4) if minibatching else (4096, 4096)
    out, _ = embedding.preprocess_sparse_dense_matmul_input(
        features,
        None,
        _specs(batch, *limits),
        local,
        global_,
        num_sc_per_device=slots,
        enable_minibatching=minibatching,
        allow_id_dropping=True,
        all_reduce_interface=_Alone() if local < global_ else None,
    )
    # With minibatching the limits force a split, so the re-keyed sort runs too.
    assert (int(out.num_minibatches[0]) > 1) == minibatching
    assert len(calls) == 1 + minibatching
    for given, got in calls:
        np.testing.assert_array_equal(got, np.sort(given))


class _Alone:
    """Other hosts contribute nothing."""

    def all_reduce_bool(self, sync_key, value):
        return value

    def all_reduce_uint64(self, sync_key, value):
        return value
