"""The layout reproduces jax-tpu-embedding's recorded outputs exactly.

The fixtures file lists, per case, the input of one feature on one table (one
device) and the reference package's row pointers, buffer size, entries per
slot and partition, and stats. The same cases also check the test oracle
(`reference_layout`), so that the property tests compare against an oracle
that is itself tied to the reference package.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from reference_layout import INT32_MAX, read_layout, reference_layout

import embedding

FIXTURES = Path(__file__).parents[2].parent / "shared/testdata/reference_preprocessing_cases.json"


def _cases() -> dict:
    if not FIXTURES.exists():
        return {}
    return json.loads(FIXTURES.read_text())["cases"]


CASES = _cases()
needs_fixtures = pytest.mark.skipif(
    not CASES, reason=f"reference fixtures not found at {FIXTURES} (shared/ next to the checkout)"
)


def _spec(case: dict) -> embedding.FeatureSpec:
    table = embedding.TableSpec(
        name="table",
        vocabulary_size=case["vocabulary_size"],
        embedding_dim=8,
        initializer=embedding.initializers.Constant(0.0),
        optimizer=embedding.SGDOptimizerSpec(),
        combiner=case["combiner"],
        max_ids_per_partition=case["max_ids_per_partition"],
        max_unique_ids_per_partition=case["max_unique_ids_per_partition"],
    )
    batch = len(case["samples"])
    return embedding.FeatureSpec(
        name="feature", table_spec=table, input_shape=[batch, 1], output_shape=[batch, 8]
    )


def _rows(rows: list[list]) -> np.ndarray:
    """A 2-D array when rectangular, else a ragged object array."""
    if len({len(r) for r in rows}) == 1:
        return np.array(rows)
    ragged = np.empty(len(rows), dtype=object)
    ragged[:] = [np.array(r) for r in rows]
    return ragged


def _library(case: dict) -> dict:
    weights = case["weights"]
    out, stats = embedding.preprocess_sparse_dense_matmul_input(
        {"feature": _rows(case["samples"])},
        None if weights is None else {"feature": _rows(weights)},
        {"feature": _spec(case)},
        1,
        case["global_device_count"],
        num_sc_per_device=case["num_sc_per_device"],
        allow_id_dropping=case["allow_id_dropping"],
    )
    return {
        "row_pointers": out.lhs_row_pointers["table"],
        "embedding_ids": out.lhs_embedding_ids["table"],
        "sample_ids": out.lhs_sample_ids["table"],
        "gains": out.lhs_gains["table"],
        "max_ids_per_partition": stats.max_ids_per_partition["table"],
        "max_unique_ids_per_partition": stats.max_unique_ids_per_partition["table"],
        "required_buffer_size_per_sc": stats.required_buffer_size_per_sc["table"],
        "id_drop_counter": stats.id_drop_counters["table"],
    }


def _oracle(case: dict) -> dict:
    specs = embedding.prepare_feature_specs_for_training(
        {"feature": _spec(case)}, case["global_device_count"], case["num_sc_per_device"]
    )
    (stack,) = reference_layout(
        {"feature": case["samples"]},
        None if case["weights"] is None else {"feature": case["weights"]},
        specs,
        local_device_count=1,
        global_device_count=case["global_device_count"],
        num_sc_per_device=case["num_sc_per_device"],
    ).values()
    return vars(stack)


@needs_fixtures
@pytest.mark.parametrize("layout", [_library, _oracle], ids=["library", "oracle"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_reproduces_reference_case(name, layout):
    case, expected = CASES[name]["input"], CASES[name]["expected"]
    got = layout(case)
    slots = case["num_sc_per_device"]
    partitions = slots * case["global_device_count"]
    coo_size = expected["coo_buffer_size"]

    assert len(got["embedding_ids"]) == coo_size
    np.testing.assert_array_equal(got["row_pointers"], expected["row_pointers"])
    # read_layout checks that every cell outside the segments is padding.
    segments = read_layout(
        got["row_pointers"],
        got["embedding_ids"],
        got["sample_ids"],
        got["gains"],
        local=1,
        slots=slots,
        partitions=partitions,
        coo_size=coo_size,
    )
    for slot, per_partition in enumerate(expected["entries_per_slot_per_partition"]):
        for p, want in enumerate(per_partition):
            have = segments[0, slot, p]
            assert [tuple(e[:2]) for e in have] == [tuple(w[:2]) for w in want], (slot, p)
            np.testing.assert_allclose(
                [e[2] for e in have], [w[2] for w in want], rtol=0, atol=1e-6
            )
    for stat in (
        "max_ids_per_partition",
        "max_unique_ids_per_partition",
        "required_buffer_size_per_sc",
        "id_drop_counter",
    ):
        np.testing.assert_array_equal(got[stat], expected[stat], err_msg=stat)


@needs_fixtures
@pytest.mark.parametrize("name", sorted(CASES))
def test_library_padding_values(name):
    """Padding is exactly (INT32_MAX, INT32_MAX, NaN) with the library's dtypes."""
    got = _library(CASES[name]["input"])
    assert got["row_pointers"].dtype == np.int32
    assert got["embedding_ids"].dtype == got["sample_ids"].dtype == np.int32
    assert got["gains"].dtype == np.float32
    pad = got["sample_ids"] == INT32_MAX
    assert pad.any(), "every fixture leaves unused buffer"
    assert (got["embedding_ids"][pad] == INT32_MAX).all()
    assert all(math.isnan(g) for g in got["gains"][pad])
    assert not np.isnan(got["gains"][~pad]).any()
