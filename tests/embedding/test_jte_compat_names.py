"""The rest of jax-tpu-embedding's names in `embedding.jte_compat`: its
optimizers, its file FDO client, `TableSpec` built inside a stack and
`QuantizationConfig` (none of these tests needs jax-tpu-embedding installed)."""

import dataclasses
import os

import jax
import numpy as np
import pytest

import embedding
from embedding import jte_compat

STATS_FIELDS = ("max_ids_per_partition", "max_unique_ids_per_partition")


def _table(**overrides) -> jte_compat.TableSpec:
    fields = dict(
        name="t",
        vocabulary_size=32,
        embedding_dim=8,
        initializer=jax.nn.initializers.zeros,
        optimizer=jte_compat.SGDOptimizerSpec(learning_rate=0.1),
        combiner="sum",
        max_ids_per_partition=16,
        max_unique_ids_per_partition=16,
    )
    return jte_compat.TableSpec(**(fields | overrides))


def _feature(table) -> jte_compat.FeatureSpec:
    return jte_compat.FeatureSpec(
        name="f", table_spec=table, input_shape=[8, 4], output_shape=[8, 8]
    )


def _stats(max_ids, max_unique, buffer=None) -> jte_compat.SparseDenseMatmulInputStats:
    return jte_compat.SparseDenseMatmulInputStats(
        max_ids_per_partition={"t": np.array(max_ids)},
        max_unique_ids_per_partition={"t": np.array(max_unique)},
        required_buffer_size_per_sc={} if buffer is None else {"t": np.array(buffer)},
    )


def _assert_stats(loaded, expected: dict) -> None:
    for field, arrays in expected.items():
        got = getattr(loaded, field)
        assert sorted(got) == sorted(arrays)
        for stack, values in arrays.items():
            np.testing.assert_array_equal(got[stack], values)


@pytest.mark.parametrize(
    ("name", "ours"),
    [
        ("LaPropOptimizerSpec", embedding.LaPropOptimizerSpec),
        ("AdagradMomentumOptimizerSpec", embedding.AdagradMomentumOptimizerSpec),
        ("F2AOptimizerSpec", embedding.F2AOptimizerSpec),
        ("LaPropSlotVariables", embedding.LaPropSlots),
        ("AdagradMomentumSlotVariables", embedding.AdagradMomentumSlots),
        ("F2ASlotVariables", embedding.F2ASlots),
        ("AdagradSlotVariables", embedding.AdagradSlots),
        ("SGDSlotVariables", embedding.SGDSlots),
    ],
)
def test_the_references_optimizer_names_are_ours(name, ours):
    assert getattr(jte_compat, name) is ours


def test_a_published_batch_loads_back(tmp_path):
    client = jte_compat.NPZFileFDOClient(tmp_path)
    client.record(_stats([10, 20, 30, 40], [1, 2, 3, 4]))
    client.publish()
    (name,) = os.listdir(tmp_path)
    assert name.startswith(f"fdo_stats_{jax.process_index()}_") and name.endswith(".npz")
    loaded = client.load()
    _assert_stats(
        loaded,
        {
            "max_ids_per_partition": {"t": [10, 20, 30, 40]},
            "max_unique_ids_per_partition": {"t": [1, 2, 3, 4]},
            "required_buffer_size_per_sc": {},
        },
    )


def test_batches_recorded_by_one_process_stack_row_by_row(tmp_path):
    """Within a process the client keeps every batch (one row each); the
    processes' files are reduced only at load."""
    client = jte_compat.NPZFileFDOClient(tmp_path / "new")  # made by publish
    client.record(_stats([5, 6], [1, 1], buffer=[64]))
    client.record(_stats([7, 2], [2, 0], buffer=[32]))
    client.publish()
    _assert_stats(
        client.load(),
        {
            "max_ids_per_partition": {"t": [[5, 6], [7, 2]]},
            "max_unique_ids_per_partition": {"t": [[1, 1], [2, 0]]},
            "required_buffer_size_per_sc": {"t": [[64], [32]]},
        },
    )


def test_load_takes_the_elementwise_max_of_every_processs_newest_file(tmp_path):
    def write(name, **arrays):
        np.savez(tmp_path / name, **{k: np.array(v) for k, v in arrays.items()})

    write("fdo_stats_0_100.npz", a_max_ids=[9, 9], a_max_unique_ids=[9, 9])  # superseded
    write("fdo_stats_0_200.npz", a_max_ids=[1, 5], a_max_unique_ids=[1, 2], b_max_ids=[3])
    write("fdo_stats_1_150.npz", a_max_ids=[4, 2], a_max_unique_ids=[3, 1], b_max_ids=[8])
    write("other.npz", a_max_ids=[99, 99])  # not a stats file
    loaded = jte_compat.NPZFileFDOClient(tmp_path).load()
    _assert_stats(
        loaded,
        {
            "max_ids_per_partition": {"a": [4, 5], "b": [8]},
            "max_unique_ids_per_partition": {"a": [3, 2]},
        },
    )


def test_newest_file_of_each_process_in_descending_process_order():
    files = [
        "d/fdo_stats_0_10.npz",
        "d/fdo_stats_0_30.npz",
        "d/fdo_stats_1_9.npz",
        "d/fdo_stats_0_20.npz",
        "d/fdo_stats_12_5.npz",
        "d/notes.txt",
    ]
    client = jte_compat.NPZFileFDOClient("d")
    assert client._get_latest_files_by_process(files) == [
        "d/fdo_stats_12_5.npz",
        "d/fdo_stats_1_9.npz",
        "d/fdo_stats_0_30.npz",
    ]


def test_load_without_files_or_with_a_foreign_array_is_an_error(tmp_path):
    client = jte_compat.NPZFileFDOClient(tmp_path)
    with pytest.raises(FileNotFoundError, match="No FDO stats files"):
        client.load()
    np.savez(tmp_path / "fdo_stats_0_1.npz", t_max_ids=np.array([1]), t_histogram=np.array([2]))
    with pytest.raises(ValueError, match="Unexpected array 't_histogram'"):
        client.load()


def test_the_stats_the_preprocessing_gives_are_recorded(tmp_path):
    specs = {"f": _feature(_table())}
    ids = np.arange(32, dtype=np.int32).reshape(8, 4)
    _, stats = jte_compat.preprocess_sparse_dense_matmul_input(
        {"f": ids}, None, specs, 1, 1, num_sc_per_device=4
    )
    client = jte_compat.NPZFileFDOClient(tmp_path)
    client.record(stats)
    client.publish()
    loaded = client.load()
    _assert_stats(loaded, {field: getattr(stats, field) for field in STATS_FIELDS})


def test_a_table_built_inside_a_stack_keeps_its_placement():
    setting = jte_compat.TableSettingInStack(
        stack_name="t", padded_vocab_size=32, padded_embedding_dim=8
    )
    stack = jte_compat.StackedTableSpec(
        stack_name="t",
        stack_vocab_size=32,
        stack_embedding_dim=8,
        optimizer=jte_compat.SGDOptimizerSpec(learning_rate=0.1),
        combiner="sum",
        total_sample_count=8,
        max_ids_per_partition=16,
        max_unique_ids_per_partition=16,
    )
    table = _table(_setting_in_stack=setting, _stacked_table_spec=stack)
    assert table.setting_in_stack == setting and table.stacked_table_spec == stack
    moved = dataclasses.replace(table, max_ids_per_partition=8)
    assert type(moved) is jte_compat.TableSpec and moved.stacked_table_spec == stack


def test_a_table_built_inside_a_stack_preprocesses_as_an_unplaced_one():
    """The reference's preprocessing tests build their tables already placed
    (for 1 device and 4 partitions); the layout equals that of plain specs."""
    setting = jte_compat.TableSettingInStack(
        stack_name="t", padded_vocab_size=48, padded_embedding_dim=8
    )
    placed = {"f": _feature(_table(_setting_in_stack=setting))}
    plain = {"f": _feature(_table())}
    ids = np.array([[2, 4, 6, 8], [10, 12, 14, 14], [1, 3, 5, 7], [9, 11, 13, 15]] * 2, np.int32)
    outputs = [
        jte_compat.preprocess_sparse_dense_matmul_input(
            {"f": ids}, None, specs, 1, 1, num_sc_per_device=4
        )[0]
        for specs in (placed, plain)
    ]
    jax.tree.map(np.testing.assert_array_equal, *outputs)


def test_quantization_config_takes_part_in_table_equality():
    config = jte_compat.QuantizationConfig(min_value=0.0, max_value=10.0, num_buckets=128)
    assert config.as_tuple() == (0.0, 10.0, 128)
    quantized = _table(quantization_config=config)
    assert quantized == _table(quantization_config=dataclasses.replace(config))
    assert hash(quantized) == hash(_table(quantization_config=config))
    assert quantized != _table()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_value": 0.0, "max_value": 1.0, "num_buckets": 1}, "num_buckets must be >= 2"),
        ({"min_value": 1.0, "max_value": 1.0, "num_buckets": 8}, "min_value .* must be <"),
    ],
)
def test_quantization_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jte_compat.QuantizationConfig(**kwargs)


def test_a_quantized_table_is_refused_by_name_when_used():
    config = jte_compat.QuantizationConfig(min_value=-1.0, max_value=1.0, num_buckets=16)
    specs = {"f": _feature(_table(name="quantized", quantization_config=config))}
    with pytest.raises(ValueError, match="TableSpec 'quantized': quantized tables"):
        jte_compat.prepare_feature_specs_for_training(specs, 1, num_sc_per_device=4)


@pytest.mark.parametrize(
    "optimizer",
    [
        jte_compat.LaPropOptimizerSpec(learning_rate=0.1),
        jte_compat.AdagradMomentumOptimizerSpec(learning_rate=0.1, use_nesterov=True),
        jte_compat.F2AOptimizerSpec(learning_rate=0.1, l2_regularization_strength=0.01),
    ],
)
def test_the_references_slot_tuples_travel_through_the_update(optimizer):
    """Variables given as the reference's `(table, slot)` with the slots in
    its order update as `embedding.apply_gradients` updates ours."""
    specs = {"f": _feature(_table(optimizer=optimizer))}
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    ids = np.arange(32, dtype=np.int32).reshape(8, 4) % 5
    preprocessed, _ = jte_compat.preprocess_sparse_dense_matmul_input(
        {"f": ids}, None, specs, 1, 1, num_sc_per_device=4
    )

    def init():
        return embedding.init_embedding_variables(
            jax.random.key(0), specs, mesh, num_sc_per_device=4
        )

    given = {
        name: jte_compat.EmbeddingVariables(v.table, tuple(v.slots)) for name, v in init().items()
    }
    grads = {"f": np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)}
    updated = jte_compat.tpu_sparse_dense_matmul_grad(grads, preprocessed, given, specs, step=2)
    expected = embedding.apply_gradients(grads, preprocessed, init(), specs, mesh, 2)
    assert type(updated["t"].slot) is optimizer.slots_type
    jax.tree.map(
        np.testing.assert_array_equal,
        (updated["t"].table, *updated["t"].slot),
        (expected["t"].table, *expected["t"].slots),
    )


def test_the_npz_clients_stats_update_the_callers_specs(tmp_path):
    """As the reference reads them: the max of each stack's arrays, the
    buffer per device its max per partition times the partitions."""
    specs = {"f": _feature(_table())}
    with pytest.raises(ValueError, match="is not prepared"):
        jte_compat.update_preprocessing_parameters(dict(specs), _stats([1], [1]), 4)
    jte_compat.prepare_feature_specs_for_training(specs, 1, num_sc_per_device=4)
    client = jte_compat.NPZFileFDOClient(tmp_path)
    client.record(_stats([3, 9, 2, 0], [1, 4, 2, 0], buffer=[8, 16, 8, 8]))
    client.record(_stats([5, 1, 1, 1], [5, 1, 1, 1], buffer=[24, 8, 8, 8]))
    client.publish()
    returned = jte_compat.update_preprocessing_parameters(specs, client.load(), 4)
    stack = specs["f"].table_spec.stacked_table_spec
    assert returned["f"] is specs["f"]
    assert (stack.max_ids_per_partition, stack.max_unique_ids_per_partition) == (9, 5)
    assert stack.suggested_coo_buffer_size_per_device == 24 * 4
