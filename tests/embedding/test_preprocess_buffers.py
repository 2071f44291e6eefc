"""Layout buffers are reused from call to call without changing any output.

A call pads again only what the previous layout wrote into a reused buffer
(module `embedding._buffers`), so every test here checks a whole buffer,
padding included, against the slow reference of docs/design.md section 2.
"""

import jax
import numpy as np
import pytest
from reference_layout import reference_layout

import embedding
from embedding._buffers import INT32_MAX, BufferPool

ROWS = 8
SLOTS = 2
# Batch A fills every slot far past where batch B's entries end; B's rows are
# shorter, so stale entries of A would show in B's padding.
DENSE = [[(7 * r + k) % 64 for k in range(8)] for r in range(ROWS)]
SPARSE = [[r] for r in range(ROWS)]
FIELDS = ("lhs_row_pointers", "lhs_embedding_ids", "lhs_sample_ids", "lhs_gains")


def _specs() -> dict[str, embedding.FeatureSpec]:
    table = embedding.TableSpec(
        name="t",
        vocabulary_size=64,
        embedding_dim=8,
        initializer=embedding.initializers.Constant(0.0),
        optimizer=embedding.SGDOptimizerSpec(),
        combiner="sum",
        max_ids_per_partition=32,
        max_unique_ids_per_partition=32,
    )
    return {
        "f": embedding.FeatureSpec(
            name="f", table_spec=table, input_shape=[ROWS, 8], output_shape=[ROWS, 8]
        )
    }


def _run(rows: list[list[int]]):
    features = np.empty(len(rows), dtype=object)
    features[:] = [np.asarray(r, np.int32) for r in rows]
    out, _ = embedding.preprocess_sparse_dense_matmul_input(
        {"f": features}, None, _specs(), 1, 1, num_sc_per_device=SLOTS
    )
    return out


def _assert_equals_reference(out, rows: list[list[int]]) -> None:
    prepared = embedding.prepare_feature_specs_for_training(_specs(), 1, SLOTS)
    want = reference_layout(
        {"f": rows},
        None,
        prepared,
        local_device_count=1,
        global_device_count=1,
        num_sc_per_device=SLOTS,
    )["t"]
    np.testing.assert_array_equal(out.lhs_row_pointers["t"], want.row_pointers)
    np.testing.assert_array_equal(out.lhs_embedding_ids["t"], want.embedding_ids)
    np.testing.assert_array_equal(out.lhs_sample_ids["t"], want.sample_ids)
    np.testing.assert_array_equal(out.lhs_gains["t"], want.gains)


def test_a_released_buffer_is_reused_all_padding_again():
    first = _run(DENSE)
    address = first.lhs_embedding_ids["t"].ctypes.data
    del first
    second = _run(SPARSE)
    # The memory is the first call's: the reuse path is the one checked.
    assert second.lhs_embedding_ids["t"].ctypes.data == address
    _assert_equals_reference(second, SPARSE)


def test_a_held_output_is_neither_reused_nor_changed():
    first = _run(DENSE)
    before = {field: np.copy(getattr(first, field)["t"]) for field in FIELDS}
    second = _run(SPARSE)
    assert second.lhs_embedding_ids["t"].ctypes.data != first.lhs_embedding_ids["t"].ctypes.data
    for field, values in before.items():
        np.testing.assert_array_equal(getattr(first, field)["t"], values, err_msg=field)
    _assert_equals_reference(second, SPARSE)


def test_a_buffer_a_device_array_aliases_is_not_reused():
    # On CPU, placing an aligned host array aliases its memory; the device
    # array must keep the buffer from being reused once the host output is gone.
    first = _run(DENSE)
    want = np.copy(first.lhs_embedding_ids["t"])
    placed = jax.device_put(first.lhs_embedding_ids["t"])
    del first
    _run(SPARSE)
    np.testing.assert_array_equal(np.asarray(placed), want)


@pytest.mark.parametrize("field", FIELDS[1:])
def test_outputs_are_read_only(field):
    # A write into an output would survive into a later call's padding.
    out = _run(SPARSE)
    with pytest.raises(ValueError, match="read-only"):
        getattr(out, field)["t"][-1] = 0


def test_unrecorded_writes_are_padded_again_everywhere():
    pool = BufferPool()
    buffers, arrays = pool.acquire(24)
    arrays.embedding_ids[:] = 5
    arrays.sample_ids[:] = 5
    arrays.gains[:] = 5
    del arrays
    again, arrays = pool.acquire(24)
    assert again is buffers
    np.testing.assert_array_equal(arrays.embedding_ids, [INT32_MAX] * 24)
    np.testing.assert_array_equal(arrays.sample_ids, [INT32_MAX] * 24)
    assert np.isnan(arrays.gains).all()


def test_a_full_pool_hands_out_unpooled_buffers():
    pool = BufferPool(max_per_size=1)
    pooled, held = pool.acquire(8)
    extra, held_extra = pool.acquire(8)
    del held, held_extra
    again, held = pool.acquire(8)
    another, _ = pool.acquire(8)
    assert again is pooled
    # Both were free; the extra one was not kept, so a new one is made.
    assert another is not extra
