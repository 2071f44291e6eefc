"""Tables and slots moved between meshes: bitwise the same logical tables, whole rows kept."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from lookup_reference import feature_specs, mesh_of

import embedding
from embedding._variables import row_sharding

# "a" keeps a slot of the table's shape, "b" and "c" (stacked) one value per row.
OPTIMIZERS = {
    "a": embedding.AdagradOptimizerSpec(learning_rate=0.1, initial_accumulator_value=0.25),
    "b": embedding.RowWiseAdagradOptimizerSpec(learning_rate=0.1, initial_accumulator_value=0.5),
    "c": embedding.RowWiseAdagradOptimizerSpec(learning_rate=0.1, initial_accumulator_value=0.5),
}
INITIAL = {"a": 0.25, "bc": 0.5}


def _specs(devices: int, slots: int):
    return feature_specs("sum", OPTIMIZERS, devices, slots)


def _random_variables(specs, devices: int, slots: int, seed: int):
    """Every stack and slot filled with random bits, padding rows and columns included."""
    rng = np.random.default_rng(seed)
    mesh = mesh_of(devices)
    prepared = embedding.prepare_feature_specs_for_training(specs, devices, slots)
    out = {}
    for name, stack in embedding.get_stacked_table_specs(prepared).items():
        shape = (stack.stack_vocab_size, stack.stack_embedding_dim)
        slot_shapes = stack.optimizer.slot_shapes(*shape)
        values = [rng.standard_normal(shape), *(rng.random(s) for s in slot_shapes)]
        placed = [jax.device_put(v.astype(np.float32), row_sharding(mesh)) for v in values]
        out[name] = embedding.EmbeddingVariables(placed[0], stack.optimizer.slots_type(*placed[1:]))
    return out


def _logical(variables, specs, devices: int, slots: int) -> dict[str, np.ndarray]:
    """The gathered tables and their slot (`<table>/accumulator`), by name."""
    mesh = mesh_of(devices)
    tables = embedding.gather_tables(
        {name: v.table for name, v in variables.items()}, specs, mesh, num_sc_per_device=slots
    )
    accumulators = embedding.gather_tables(
        {name: v.slots.accumulator for name, v in variables.items()},
        specs,
        mesh,
        num_sc_per_device=slots,
    )
    return tables | {f"{name}/accumulator": v for name, v in accumulators.items()}


def _rows(specs, devices: int, slots: int) -> dict[str, np.ndarray]:
    """docs/design.md section 1: id i in partition (i + rotation) mod N at local row
    offset + i div N; physical row partition * R + local row."""
    n = devices * slots
    prepared = embedding.prepare_feature_specs_for_training(specs, devices, slots)
    rows = {}
    for feature in prepared.values():
        table = feature.table_spec
        setting = table.setting_in_stack
        ids = np.arange(table.vocabulary_size)
        per_partition = table.stacked_table_spec.stack_vocab_size // n
        rows[table.name] = ((ids + setting.shard_rotation) % n) * per_partition + (
            setting.row_offset_in_shard + ids // n
        )
    return rows


MOVES = [((8, 2), (4, 2)), ((8, 2), (8, 1)), ((2, 4), (8, 2)), ((4, 1), (1, 1))]


def _relayout(saved, old_specs, new_specs, old, new):
    """`saved` (laid out for mesh `old` = (devices, partitions)) laid out for `new`."""
    return embedding.relayout_embedding_variables(
        saved,
        old_specs,
        new_specs,
        from_devices=old[0],
        from_sc_per_device=old[1],
        to_devices=new[0],
        to_sc_per_device=new[1],
        mesh=mesh_of(new[0]),
    )


@pytest.mark.parametrize(("old", "new"), MOVES, ids=[f"{a}->{b}" for a, b in MOVES])
def test_relaid_variables_gather_to_the_same_tables_and_slots_bitwise(old, new):
    old_specs, new_specs = _specs(*old), _specs(*new)
    saved = _random_variables(old_specs, *old, seed=sum(old) + sum(new))
    relaid = _relayout(saved, old_specs, new_specs, old, new)
    expected, got = _logical(saved, old_specs, *old), _logical(relaid, new_specs, *new)
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert got[name].tobytes() == expected[name].tobytes(), name
    for variables in relaid.values():
        for leaf in jax.tree.leaves(variables):
            assert leaf.sharding.is_equivalent_to(row_sharding(mesh_of(new[0])), leaf.ndim)


@pytest.mark.parametrize(("old", "new"), MOVES[:2], ids=[f"{a}->{b}" for a, b in MOVES[:2]])
def test_whole_rows_move_and_padding_rows_start_as_a_new_tables(old, new):
    old_specs, new_specs = _specs(*old), _specs(*new)
    saved = _random_variables(old_specs, *old, seed=3)
    relaid = _relayout(saved, old_specs, new_specs, old, new)
    old_rows, new_rows = _rows(old_specs, *old), _rows(new_specs, *new)
    for stack, tables in {"a": ["a"], "bc": ["b", "c"]}.items():
        before, after = np.asarray(saved[stack].table), np.asarray(relaid[stack].table)
        slot_before = np.asarray(saved[stack].slots.accumulator)
        slot_after = np.asarray(relaid[stack].slots.accumulator)
        padding = np.ones(after.shape[0], bool)
        for table in tables:
            # The padding columns of "b" (dim 5 of 8) move with their row.
            np.testing.assert_array_equal(after[new_rows[table]], before[old_rows[table]])
            np.testing.assert_array_equal(slot_after[new_rows[table]], slot_before[old_rows[table]])
            padding[new_rows[table]] = False
        assert padding.any()
        assert (after[padding] == 0).all()
        assert (slot_after[padding] == np.float32(INITIAL[stack])).all()


def test_restack_lays_the_same_stacks_out_for_another_mesh():
    assert embedding.restack(_specs(8, 2), 4, 2) == _specs(4, 2)
    assert embedding.restack(_specs(2, 4), 8, 1) == _specs(8, 1)


def test_shapes_of_a_layout_are_those_init_makes():
    specs, mesh = _specs(4, 2), mesh_of(8)
    made = embedding.init_embedding_variables(
        jax.random.key(0), specs, mesh_of(4), num_sc_per_device=2
    )
    shapes = embedding.embedding_variables_shapes(specs, 4, 2, mesh)
    assert jax.tree.map(lambda x: x.shape, shapes) == jax.tree.map(lambda x: x.shape, made)
    # 4 x 2 partitions pad the rows to a multiple of 64, which 8 devices divide.
    assert all(x.sharding.is_equivalent_to(row_sharding(mesh), 1) for x in jax.tree.leaves(shapes))
    # 3 devices divide the 384 rows of "bc" but not the 320 of "a", which every device holds whole.
    on_three = embedding.embedding_variables_shapes(specs, 4, 2, mesh_of(3))
    assert [x.shape[0] for x in jax.tree.leaves(on_three["a"])] == [320, 320]
    assert all(x.sharding.spec == PartitionSpec() for x in jax.tree.leaves(on_three["a"]))
    assert all(x.sharding.spec != PartitionSpec() for x in jax.tree.leaves(on_three["bc"]))


def test_variables_of_another_layout_are_refused_naming_the_stack():
    saved = _random_variables(_specs(4, 2), 4, 2, seed=0)
    with pytest.raises(ValueError, match=r"Stack 'a' has shape \[320, 8\], but on 8 devices x 2"):
        embedding.relayout_embedding_variables(
            saved,
            _specs(8, 2),
            _specs(4, 2),
            from_devices=8,
            from_sc_per_device=2,
            to_devices=4,
            to_sc_per_device=2,
            mesh=mesh_of(4),
        )


def test_layouts_that_stack_the_tables_differently_are_refused():
    saved = _random_variables(_specs(4, 2), 4, 2, seed=0)
    unstacked = {
        name: dataclasses.replace(
            f,
            table_spec=dataclasses.replace(
                f.table_spec, stacked_table_spec=None, setting_in_stack=None
            ),
            id_transformation=None,
        )
        for name, f in _specs(4, 2).items()
    }
    with pytest.raises(
        ValueError, match=r"stacks the tables as \{'a': \['a'\], 'bc': \['b', 'c'\]\}"
    ):
        embedding.relayout_embedding_variables(
            saved,
            _specs(4, 2),
            unstacked,
            from_devices=4,
            from_sc_per_device=2,
            to_devices=8,
            to_sc_per_device=2,
            mesh=mesh_of(8),
        )
