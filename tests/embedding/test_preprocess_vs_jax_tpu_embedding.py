"""Drop counts and stats against jax-tpu-embedding 0.1.0 itself, when installed.

The peer is the optional extra `bench`; without it these tests are skipped
and the hand cases and property tests stand for it.
"""

import jax
import numpy as np
import pytest

import embedding

jte = pytest.importorskip("jax_tpu_embedding.sparsecore.lib.nn.embedding")
jte_spec = pytest.importorskip("jax_tpu_embedding.sparsecore.lib.nn.embedding_spec")

SLOTS = 2
STAT_FIELDS = (
    "max_ids_per_partition",
    "max_unique_ids_per_partition",
    "required_buffer_size_per_sc",
    "id_drop_counters",
)


def _run_both(rows: list[list[int]], **limits):
    ids = np.empty(len(rows), dtype=object)
    ids[:] = [np.asarray(r, np.int32) for r in rows]
    common = dict(name="t", vocabulary_size=64, embedding_dim=8, combiner="sum", **limits)
    shapes = dict(input_shape=[len(rows), 1], output_shape=[len(rows), 8])
    ours = embedding.TableSpec(
        initializer=embedding.initializers.Constant(0.0),
        optimizer=embedding.SGDOptimizerSpec(),
        **common,
    )
    theirs = jte_spec.TableSpec(
        initializer=jax.nn.initializers.zeros, optimizer=jte_spec.SGDOptimizerSpec(), **common
    )
    their_specs = {"f": jte_spec.FeatureSpec(name="f", table_spec=theirs, **shapes)}
    jte.prepare_feature_specs_for_training(their_specs, 1, SLOTS)
    kwargs = dict(num_sc_per_device=SLOTS, allow_id_dropping=True)
    return (
        embedding.preprocess_sparse_dense_matmul_input(
            {"f": ids},
            None,
            {"f": embedding.FeatureSpec(name="f", table_spec=ours, **shapes)},
            1,
            1,
            **kwargs,
        ),
        jte.preprocess_sparse_dense_matmul_input({"f": ids}, None, their_specs, 1, 1, **kwargs),
    )


def _assert_same(ours, theirs) -> None:
    (out, stats), (their_out, their_stats) = ours, theirs
    for field in STAT_FIELDS:
        np.testing.assert_array_equal(
            getattr(stats, field)["t"], getattr(their_stats, field)["t"], err_msg=field
        )
    np.testing.assert_array_equal(out.lhs_row_pointers["t"], their_out.lhs_row_pointers["t"])


@pytest.mark.parametrize(
    ("rows", "limits"),
    [
        ([[0, 0, 2, 2, 4, 4], [6, 6, 8, 8]], dict(max_unique_ids_per_partition=1)),
        ([[0, 0, 0, 2, 4, 4, 4], [6]], dict(max_ids_per_partition=1)),
    ],
)
def test_hand_cases_drop_as_the_reference(rows, limits):
    limits = dict(dict(max_ids_per_partition=8, max_unique_ids_per_partition=8), **limits)
    _assert_same(*_run_both(rows, **limits))


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_drop_as_the_reference(seed):
    # Few distinct ids and tight limits: duplicates inside rows and drops by
    # both limits in every batch.
    rng = np.random.default_rng(seed)
    rows = [list(rng.integers(0, 12, rng.integers(1, 9))) for _ in range(16)]
    ours, theirs = _run_both(rows, max_ids_per_partition=5, max_unique_ids_per_partition=3)
    assert ours[1].id_drop_counters["t"] > 0
    _assert_same(ours, theirs)
