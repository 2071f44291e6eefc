"""Sharded embedding variables: initialization, row order, gather and errors."""

import re

import jax
import numpy as np
import pytest
from lookup_reference import TABLES, feature_specs, mesh_of

import embedding
from embedding._variables import init_program

ADAGRAD = embedding.AdagradOptimizerSpec(learning_rate=0.1, initial_accumulator_value=0.25)


def _specs(devices: int, slots: int):
    return feature_specs("sum", ADAGRAD, devices, slots)


def _gather(variables, specs, mesh, slots, field="table"):
    stacks = {
        name: v.table if field == "table" else getattr(v.slots, field)
        for name, v in variables.items()
    }
    return embedding.gather_tables(stacks, specs, mesh, num_sc_per_device=slots)


def _sharded_row(table: embedding.TableSpec, ids: np.ndarray, partitions: int) -> np.ndarray:
    """docs/design.md sections 1 and 5: partition (id + rotation) mod N, local row
    offset + id div N; physical row partition * R + local row."""
    setting = table.setting_in_stack
    rows_per_partition = table.stacked_table_spec.stack_vocab_size // partitions
    partition = (ids + setting.shard_rotation) % partitions
    local = setting.row_offset_in_shard + ids // partitions
    return partition * rows_per_partition + local


@pytest.mark.parametrize(("devices", "slots"), [(8, 1), (2, 4)])
def test_init_is_the_initializer_in_logical_order(devices, slots):
    specs, mesh = _specs(devices, slots), mesh_of(devices)
    key = jax.random.key(7)
    variables = jax.block_until_ready(
        embedding.init_embedding_variables(key, specs, mesh, num_sc_per_device=slots)
    )
    tables = _gather(variables, specs, mesh, slots)
    for name, (vocab, dim) in TABLES.items():
        expected = embedding.initializers.Normal(stddev=1.0)(
            embedding.table_key(key, name), (vocab, dim)
        )
        np.testing.assert_array_equal(tables[name], np.asarray(expected))
    accumulators = _gather(variables, specs, mesh, slots, "accumulator")
    for name in TABLES:
        assert (accumulators[name] == np.float32(0.25)).all()


def test_a_key_of_another_generator_draws_each_table_whole():
    """An rbg key's draws depend on the shape drawn: each table is drawn whole
    (not by blocks of rows) and is still its initializer's logical draw."""
    devices, slots = 2, 2
    specs, mesh = _specs(devices, slots), mesh_of(devices)
    key = jax.random.key(7, impl="rbg")
    variables = embedding.init_embedding_variables(key, specs, mesh, num_sc_per_device=slots)
    tables = _gather(jax.block_until_ready(variables), specs, mesh, slots)
    for name, (vocab, dim) in TABLES.items():
        expected = embedding.initializers.Normal(stddev=1.0)(
            embedding.table_key(key, name), (vocab, dim)
        )
        np.testing.assert_array_equal(tables[name], np.asarray(expected))


def test_init_is_deterministic_and_depends_on_the_seed():
    specs, mesh = _specs(4, 2), mesh_of(4)

    def tables(seed):
        variables = embedding.init_embedding_variables(
            jax.random.key(seed), specs, mesh, num_sc_per_device=2
        )
        return _gather(jax.block_until_ready(variables), specs, mesh, 2)

    first, again, other = tables(3), tables(3), tables(4)
    for name in TABLES:
        np.testing.assert_array_equal(first[name], again[name])
        assert not np.array_equal(first[name], other[name])


def test_init_runs_shard_by_shard():
    """Every device holds its own rows, and no op of the compiled program has a
    whole (logical or stacked) table's shape."""
    devices, slots = 8, 1
    specs, mesh = _specs(devices, slots), mesh_of(devices)
    variables = jax.block_until_ready(
        embedding.init_embedding_variables(jax.random.key(0), specs, mesh, num_sc_per_device=slots)
    )
    stacked = embedding.get_stacked_table_specs(
        embedding.prepare_feature_specs_for_training(specs, devices, slots)
    )
    for name, spec in stacked.items():
        table = variables[name].table
        assert table.shape == (spec.stack_vocab_size, spec.stack_embedding_dim)
        shards = table.addressable_shards
        assert len({s.device for s in shards}) == devices
        assert {s.data.shape[0] for s in shards} == {spec.stack_vocab_size // devices}
    text = init_program(specs, mesh, slots).lower(jax.random.key(0)).compile().as_text()
    whole = {vocab for vocab, _ in TABLES.values()}
    whole |= {spec.stack_vocab_size for spec in stacked.values()}
    leading = {int(d) for d in re.findall(r"f32\[(\d+),", text)}
    assert leading and not leading & whole


@pytest.mark.parametrize(("devices", "slots"), [(1, 2), (4, 2)])
def test_logical_and_sharded_order_round_trip(devices, slots):
    specs, mesh = _specs(devices, slots), mesh_of(devices)
    rng = np.random.default_rng(0)
    logical = {
        name: rng.normal(size=(vocab, dim)).astype(np.float32)
        for name, (vocab, dim) in TABLES.items()
    }
    stacks = jax.block_until_ready(
        embedding.shard_tables(logical, specs, mesh, num_sc_per_device=slots)
    )
    back = embedding.gather_tables(stacks, specs, mesh, num_sc_per_device=slots)
    prepared = {
        f.table_spec.name: f.table_spec
        for f in jax.tree.leaves(
            embedding.prepare_feature_specs_for_training(specs, devices, slots)
        )
    }
    for name, values in logical.items():
        np.testing.assert_array_equal(back[name], values)
        table = prepared[name]
        ids = np.arange(table.vocabulary_size)
        rows = _sharded_row(table, ids, devices * slots)
        stack = np.asarray(stacks[table.stacked_table_spec.stack_name])
        np.testing.assert_array_equal(stack[rows, : table.embedding_dim], values)
        assert (stack[rows, table.embedding_dim :] == 0).all()


def test_shard_tables_needs_every_table_of_a_stack():
    specs, mesh = _specs(2, 1), mesh_of(2)
    with pytest.raises(ValueError, match=r"stack 'bc' also needs tables \['c'\]"):
        embedding.shard_tables({"b": np.zeros((200, 5))}, specs, mesh, num_sc_per_device=1)


def test_shard_tables_rejects_a_wrong_shape():
    specs, mesh = _specs(2, 1), mesh_of(2)
    with pytest.raises(ValueError, match=r"Table 'a'.*\[300, 8\].*\[300, 7\]"):
        embedding.shard_tables({"a": np.zeros((300, 7))}, specs, mesh, num_sc_per_device=1)


def test_gather_tables_rejects_an_unknown_stack():
    specs, mesh = _specs(2, 1), mesh_of(2)
    with pytest.raises(ValueError, match="unknown stack 'nope'"):
        embedding.gather_tables({"nope": np.zeros((8, 8))}, specs, mesh, num_sc_per_device=1)


@pytest.mark.parametrize(("devices", "slots"), [(1, 1), (2, 2)])
def test_alike_tables_of_a_stack_start_as_their_own_initializer(devices, slots):
    """Tables of one initializer and shape are drawn together; each still gets
    `initializer(table_key(key, name), shape)`, in its own place of the stack."""
    normal = embedding.initializers.Normal(stddev=1.0)
    shapes = {
        "u": (128, 8, normal),
        "v": (128, 8, embedding.initializers.TruncatedNormal(stddev=0.5)),
        "w": (128, 8, normal),
        "x": (64, 8, normal),
        "y": (128, 8, embedding.initializers.Normal(stddev=1.0)),
        # Its values depend on the shape drawn: drawn as the logical table.
        "z": (96, 8, jax.nn.initializers.glorot_normal()),
    }
    tables = {
        name: embedding.TableSpec(
            name=name,
            vocabulary_size=vocab,
            embedding_dim=dim,
            initializer=initializer,
            optimizer=ADAGRAD,
            combiner="sum",
            max_ids_per_partition=32,
            max_unique_ids_per_partition=32,
        )
        for name, (vocab, dim, initializer) in shapes.items()
    }
    specs = {
        name: embedding.FeatureSpec(
            name=name, table_spec=table, input_shape=[16, 2], output_shape=[16, table.embedding_dim]
        )
        for name, table in tables.items()
    }
    specs = embedding.stack_tables(specs, list(tables), devices, slots, stack_name="all")
    mesh, key = mesh_of(devices), jax.random.key(11)
    variables = jax.block_until_ready(
        embedding.init_embedding_variables(key, specs, mesh, num_sc_per_device=slots)
    )
    assert list(variables) == ["all"]
    gathered = _gather(variables, specs, mesh, slots)
    for name, (vocab, dim, initializer) in shapes.items():
        expected = initializer(embedding.table_key(key, name), (vocab, dim))
        np.testing.assert_array_equal(gathered[name], np.asarray(expected), err_msg=name)


def _alike_stack(tables: int, vocab: int, dim: int, devices: int, slots: int):
    """`tables` tables of one truncated-normal initializer and shape, stacked as "s"."""
    specs = {
        f"f{t}": embedding.FeatureSpec(
            name=f"f{t}",
            table_spec=embedding.TableSpec(
                name=f"t{t}",
                vocabulary_size=vocab,
                embedding_dim=dim,
                initializer=embedding.initializers.TruncatedNormal(stddev=0.1),
                optimizer=embedding.SGDOptimizerSpec(),
                combiner="sum",
                max_ids_per_partition=64,
                max_unique_ids_per_partition=64,
            ),
            input_shape=[16, 2],
            output_shape=[16, dim],
        )
        for t in range(tables)
    }
    names = [f"t{t}" for t in range(tables)]
    return embedding.stack_tables(specs, names, devices, slots, stack_name="s")


def test_a_stack_of_alike_tables_is_drawn_without_temporaries_of_the_whole_stack():
    """XLA:CPU's random numbers hold about three times the array they draw; drawn
    table by table into the stack, the program's temporaries stay below one stack."""
    tables, vocab, dim = 8, 20_000, 16
    specs = _alike_stack(tables, vocab, dim, 1, 1)
    program = init_program(specs, mesh_of(1), 1).lower(jax.random.key(0)).compile()
    stack_bytes = tables * vocab * dim * 4
    assert program.memory_analysis().temp_size_in_bytes < stack_bytes


def test_a_large_table_is_drawn_with_temporaries_far_below_it():
    """Drawn a block of rows at a time, a table's random-number temporaries are
    those of a block, not of the table (drawn whole they were several tables)."""
    vocab, dim = 2**22, 16  # compiled only: never allocated
    specs = _alike_stack(1, vocab, dim, 1, 1)
    program = init_program(specs, mesh_of(1), 1).lower(jax.random.key(0)).compile()
    assert program.memory_analysis().temp_size_in_bytes < vocab * dim * 4 / 4


def test_tables_on_several_devices_are_drawn_where_their_partitions_are():
    """Each device draws only its partitions' ids: no table is gathered or
    exchanged whole, and the temporaries stay below the device's share."""
    devices, slots = 8, 2
    specs = _alike_stack(8, 20_000, 16, devices, slots)
    program = init_program(specs, mesh_of(devices), slots).lower(jax.random.key(0)).compile()
    assert not re.search(r"all-gather|all-to-all", program.as_text())
    memory = program.memory_analysis()
    assert memory.temp_size_in_bytes < memory.output_size_in_bytes
