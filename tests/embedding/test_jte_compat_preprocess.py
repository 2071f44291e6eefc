"""What jax-tpu-embedding's preprocessing tests ask of `embedding.jte_compat`.

The later versions' `sc_simd_width`, tables placed in a stack by hand and
edited in place, the reference's limit on a device's batch, and a batch
whose layout keys need the full 64 bits. Layouts are compared with
jax-tpu-embedding 0.1.0's own CPU preprocessing where it can run the case,
else with layouts derived by hand.
"""

import dataclasses

import jax
import numpy as np
import pytest
from jte_layout import assert_same_layout

import embedding
from embedding import jte_compat

jte = pytest.importorskip("jax_tpu_embedding.sparsecore.lib.nn.embedding")
jte_spec = pytest.importorskip("jax_tpu_embedding.sparsecore.lib.nn.embedding_spec")

COO_LIMIT = (1 << 26) - 1


def _table(
    spec_module, name: str, vocab: int, *, placed_for: int | None = None, stack_max_ids=16, **limits
):
    """A sum table with limits 16; `placed_for=vocab` puts it, padded to that
    vocabulary, alone in a stack of its name as the reference's tests do,
    with `stack_max_ids` ids per partition."""
    limits = dict(max_ids_per_partition=16, max_unique_ids_per_partition=16) | limits
    placement = {}
    if placed_for is not None:
        placement = dict(
            _setting_in_stack=spec_module.TableSettingInStack(
                stack_name=name, padded_vocab_size=placed_for, padded_embedding_dim=8
            ),
            _stacked_table_spec=spec_module.StackedTableSpec(
                stack_name=name,
                stack_vocab_size=placed_for,
                stack_embedding_dim=8,
                optimizer=spec_module.SGDOptimizerSpec(learning_rate=0.1),
                combiner="sum",
                total_sample_count=16,
                **(limits | dict(max_ids_per_partition=stack_max_ids)),
            ),
        )
    return spec_module.TableSpec(
        name=name,
        vocabulary_size=vocab,
        embedding_dim=8,
        initializer=jax.nn.initializers.zeros,
        optimizer=spec_module.SGDOptimizerSpec(learning_rate=0.1),
        combiner="sum",
        **limits,
        **placement,
    )


def _feature(spec_module, name: str, table, batch: int = 16, valency: int = 3):
    return spec_module.FeatureSpec(
        name=name, table_spec=table, input_shape=[batch, valency], output_shape=[batch, 8]
    )


def _ragged(rows) -> np.ndarray:
    out = np.empty(len(rows), dtype=object)
    out[:] = [np.asarray(r, np.int32) for r in rows]
    return out


def _batch(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "dense": rng.integers(0, 40, size=(16, 3)).astype(np.int32),
        "ragged": _ragged([rng.integers(0, 24, size=rng.integers(1, 4)) for _ in range(16)]),
    }


def _placed_specs(spec_module, ragged_stack_max_ids: int = 16) -> dict:
    """Two hand-placed tables padded to 48 rows, a stack valid for 2
    partitions only, as in the reference's tests."""
    ragged = _table(spec_module, "b", 24, placed_for=48, stack_max_ids=ragged_stack_max_ids)
    return {
        "dense": _feature(spec_module, "dense", _table(spec_module, "a", 40, placed_for=48)),
        "ragged": _feature(spec_module, "ragged", ragged),
    }


def _set_buffer(table, size: int) -> None:
    """The reference's in-place edit of a stack's buffer size."""
    table.stacked_table_spec = dataclasses.replace(
        table.stacked_table_spec, suggested_coo_buffer_size_per_device=size
    )


def _layout(result) -> dict:
    return result[0].sparse_dense_matmul_input._asdict()


@pytest.mark.parametrize(("local", "global_", "slots"), [(1, 1, 4), (2, 2, 4), (1, 4, 2)])
def test_hand_placed_tables_lay_out_as_the_reference_reads_them(local, global_, slots):
    """The reference reads a hand-placed table with its stack's limits (here
    1 id per partition for table b, 16 for the table itself) and no id
    transformation, whatever the partition count its padding was made for;
    so does `jte_compat` (it pads for the geometry at hand)."""
    batch = _batch(seed=global_ * slots)
    if local < global_:
        batch = {name: ids[: 16 * local // global_] for name, ids in batch.items()}
    kwargs = dict(num_sc_per_device=slots, allow_id_dropping=True)
    ours = jte_compat.preprocess_sparse_dense_matmul_input(
        batch, None, _placed_specs(jte_compat, 1), local, global_, sc_simd_width=8, **kwargs
    )
    theirs = jte.preprocess_sparse_dense_matmul_input(
        batch, None, _placed_specs(jte_spec, 1), local, global_, **kwargs
    )
    assert sorted(_layout(ours)["lhs_row_pointers"]) == ["a", "b"]
    assert_same_layout(_layout(ours), _layout(theirs), devices=local, slots=slots)
    assert ours[1].id_drop_counters == theirs[1].id_drop_counters
    assert ours[1].id_drop_counters["b"] > 0 == ours[1].id_drop_counters["a"]


def test_an_in_place_edit_of_a_hand_placed_stack_sizes_the_buffer_as_in_the_reference():
    """`table.stacked_table_spec = replace(...)` on a table placed by hand."""
    results = []
    for spec_module, module in ((jte_compat, jte_compat), (jte_spec, jte)):
        specs = _placed_specs(spec_module)
        _set_buffer(specs["ragged"].table_spec, 128)
        results.append(
            module.preprocess_sparse_dense_matmul_input(
                _batch(seed=5), None, specs, 1, 1, num_sc_per_device=4
            )
        )
    ours, theirs = (_layout(result) for result in results)
    # 128 entries per device (32 per slot), against roundup8(16) * 4 * 4 = 256 unedited.
    assert ours["lhs_embedding_ids"]["b"].shape == theirs["lhs_embedding_ids"]["b"].shape == (128,)
    assert ours["lhs_embedding_ids"]["a"].shape == (256,)
    assert_same_layout(ours, theirs, devices=1, slots=4)


def test_an_in_place_edit_of_a_prepared_stack_sizes_the_buffer_as_in_the_reference():
    """The edit after `prepare_feature_specs_for_training`, through the
    caller's dict (where both libraries leave the prepared specs)."""
    results = []
    for spec_module, module in ((jte_compat, jte_compat), (jte_spec, jte)):
        specs = {"dense": _feature(spec_module, "dense", _table(spec_module, "a", 40))}
        module.prepare_feature_specs_for_training(specs, 1, 4)
        _set_buffer(specs["dense"].table_spec, 120)
        results.append(
            module.preprocess_sparse_dense_matmul_input(
                {"dense": _batch(seed=6)["dense"]}, None, specs, 1, 1, num_sc_per_device=4
            )
        )
    ours, theirs = (_layout(result) for result in results)
    # Rounded up to whole slots of 8-entry steps: 4 slots x 32.
    assert ours["lhs_gains"]["a"].shape == theirs["lhs_gains"]["a"].shape == (128,)
    assert_same_layout(ours, theirs, devices=1, slots=4)


def test_a_hand_placed_table_over_its_buffer_is_refused_where_the_reference_drops():
    """The reference drops what overflows a buffer even with dropping off;
    `jte_compat` raises, naming the slot and the fix, and with dropping on
    drops what the reference drops."""
    results = []
    for spec_module, module in ((jte_compat, jte_compat), (jte_spec, jte)):
        specs = _placed_specs(spec_module)
        _set_buffer(specs["dense"].table_spec, 32)
        if module is jte_compat:
            with pytest.raises(ValueError, match="slot's buffer of 8 entries .* too small"):
                module.preprocess_sparse_dense_matmul_input(
                    _batch(seed=7), None, specs, 1, 1, num_sc_per_device=4
                )
        results.append(
            module.preprocess_sparse_dense_matmul_input(
                _batch(seed=7), None, specs, 1, 1, num_sc_per_device=4, allow_id_dropping=True
            )
        )
    (ours, our_stats), (theirs, their_stats) = results
    assert ours.lhs_embedding_ids["a"].shape == theirs.lhs_embedding_ids["a"].shape == (32,)
    assert our_stats.id_drop_counters["a"] == their_stats.id_drop_counters["a"] > 0
    assert_same_layout(_layout(results[0]), _layout(results[1]), devices=1, slots=4)


def test_a_table_placed_with_others_needs_the_transformation_stacking_gives():
    setting = jte_compat.TableSettingInStack(
        stack_name="ab", padded_vocab_size=48, padded_embedding_dim=8, row_offset_in_shard=6
    )
    stack = _table(jte_compat, "a", 40, placed_for=96).stacked_table_spec
    table = _table(jte_compat, "a", 40)
    table.setting_in_stack = setting
    table.stacked_table_spec = dataclasses.replace(stack, stack_name="ab")
    with pytest.raises(ValueError, match="Feature 'dense': table 'a' is placed in stack 'ab'"):
        jte_compat.preprocess_sparse_dense_matmul_input(
            {"dense": _batch(seed=8)["dense"]},
            None,
            {"dense": _feature(jte_compat, "dense", table)},
            1,
            1,
            num_sc_per_device=4,
        )


def test_tables_are_edited_in_place_under_the_references_rules():
    table = _table(jte_compat, "t", 40)
    table.max_ids_per_partition = 32
    table.combiner = "mean"
    assert table.max_ids_per_partition == 32 and table.combiner is embedding.Combiner.MEAN
    with pytest.raises(ValueError, match="max_unique_ids_per_partition must be a positive"):
        table.max_unique_ids_per_partition = 0
    assert table.max_unique_ids_per_partition == 16  # a refused edit changes nothing
    with pytest.raises(AttributeError, match="no field 'max_ids'"):
        table.max_ids = 3
    specs = {"f": _feature(jte_compat, "f", table)}
    jte_compat.prepare_feature_specs_for_training(specs, 1, 4)
    prepared = specs["f"].table_spec
    assert isinstance(prepared, jte_compat.TableSpec)
    with pytest.raises(AttributeError, match="use update_preprocessing_parameters"):
        prepared.max_ids_per_partition = 8
    with pytest.raises(AttributeError, match=r"dataclasses.replace\(table_spec"):
        prepared.vocabulary_size = 64
    prepared.setting_in_stack = dataclasses.replace(prepared.setting_in_stack)  # allowed
    ours = embedding.prepare_feature_specs_for_training(
        {"f": _feature(embedding, "f", _table(embedding, "t", 40))}, 1, 4
    )["f"].table_spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        ours.stacked_table_spec = prepared.stacked_table_spec


def test_sc_simd_width_8_is_this_layout_and_other_widths_are_refused():
    specs = {"dense": _feature(jte_compat, "dense", _table(jte_compat, "a", 40))}
    ids = {"dense": _batch(seed=9)["dense"]}

    def preprocess(**kwargs):
        return jte_compat.preprocess_sparse_dense_matmul_input(
            ids, None, specs, 1, 1, num_sc_per_device=4, **kwargs
        )

    their_specs = {"dense": _feature(jte_spec, "dense", _table(jte_spec, "a", 40))}
    jte.prepare_feature_specs_for_training(their_specs, 1, 4)
    reference = jte.preprocess_sparse_dense_matmul_input(
        ids, None, their_specs, 1, 1, num_sc_per_device=4
    )
    for width in (8, None):
        assert_same_layout(
            _layout(preprocess(sc_simd_width=width)), _layout(reference), devices=1, slots=4
        )
    for width in (16, 4, True, "8"):
        with pytest.raises(ValueError, match=rf"sc_simd_width={width!r} is not supported"):
            preprocess(sc_simd_width=width)


def test_a_devices_batch_over_the_references_coo_limit_is_refused_before_any_id_is_read():
    """Per device and per stack (features of one table stack their samples);
    the ids are never read, so a placeholder batch shows the order."""
    placeholder = np.zeros((8, 1), np.int32)

    def preprocess(batches: dict[str, int], global_devices: int):
        table = _table(jte_compat, "t", 40)
        specs = {
            name: _feature(jte_compat, name, table, batch=batch, valency=1)
            for name, batch in batches.items()
        }
        return jte_compat.preprocess_sparse_dense_matmul_input(
            dict.fromkeys(batches, placeholder), None, specs, 1, global_devices,
            num_sc_per_device=2, allow_id_dropping=True,
        )  # fmt: skip

    limit = "exceeds the maximum limit supported by the SparseCore CooFormat"
    with pytest.raises(
        ValueError, match=f"Stack 't': the local batch of {COO_LIMIT + 1} .*{limit}"
    ):
        preprocess({"f": COO_LIMIT + 1}, 1)
    with pytest.raises(ValueError, match=limit):
        preprocess({"f": 2 * (COO_LIMIT + 1)}, 2)
    with pytest.raises(ValueError, match=f"{COO_LIMIT + 1} samples per device .*{limit}"):
        preprocess({"f": (COO_LIMIT + 1) // 2, "g": (COO_LIMIT + 1) // 2}, 1)
    # Within the limit the batch is read: the placeholder's 8 rows are refused.
    for batches, devices in (({"f": (COO_LIMIT + 1) // 2}, 1), ({"f": 4 * (COO_LIMIT + 1)}, 8)):
        with pytest.raises(ValueError, match="rows") as refused:
            preprocess(batches, devices)
        assert "CooFormat" not in str(refused.value)


def test_a_batch_whose_keys_need_every_bit_lays_out_with_unit_weights():
    """2 partitions (one device, 2 slots), 2**31 rows per partition, 2**16
    samples per slot: (slot, partition, local id, sample) takes 1 + 1 + 31 +
    16 = 49 bits, and the 2**17 entries' positions 17 more. Without weights
    the layout needs no positions; with weights the 66 bits are refused.

    Row r looks up id 2**32 - 4 + r % 2: partition r % 2, local id 2**31 - 2.
    Slot s holds rows s * 2**16 + j as sample j: partition 0 the even
    samples, partition 1 the odd ones, 2**15 each.
    """
    rows = 1 << 17
    table = _table(
        jte_compat, "t", 1 << 32, max_ids_per_partition=1 << 15, max_unique_ids_per_partition=1
    )
    specs = {"f": _feature(jte_compat, "f", table, batch=rows, valency=1)}
    ids = (np.int64(2**32 - 4) + np.arange(rows) % 2).reshape(rows, 1)
    out, stats = jte_compat.preprocess_sparse_dense_matmul_input(
        {"f": ids}, None, specs, 1, 1, num_sc_per_device=2, sc_simd_width=8
    )
    half = 1 << 15
    per_slot = np.concatenate([[half, 2 * half], np.full(6, 2 * half)])
    np.testing.assert_array_equal(out.lhs_row_pointers["t"], np.tile(per_slot, 2))
    samples = np.concatenate([np.arange(0, 2 * half, 2), np.arange(1, 2 * half, 2)])
    np.testing.assert_array_equal(out.lhs_sample_ids["t"], np.tile(samples, 2))
    np.testing.assert_array_equal(out.lhs_embedding_ids["t"], np.full(4 * half, 2**31 - 2))
    np.testing.assert_array_equal(out.lhs_gains["t"], np.ones(4 * half, np.float32))
    assert stats.id_drop_counters["t"] == 0
    with pytest.raises(ValueError, match="layout key needs 66 bits"):
        jte_compat.preprocess_sparse_dense_matmul_input(
            {"f": ids}, {"f": np.ones((rows, 1), np.float32)}, specs, 1, 1, num_sc_per_device=2
        )
