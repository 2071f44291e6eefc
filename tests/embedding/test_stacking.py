"""Feature stacking and table stacking: the spec fields, derived by hand."""

import functools

import pytest

import embedding

Table = functools.partial(
    embedding.TableSpec,
    embedding_dim=8,
    initializer=embedding.initializers.Constant(0.0),
    optimizer=embedding.SGDOptimizerSpec(),
    combiner="sum",
)


def _feature(name, table, batch=16):
    return embedding.FeatureSpec(
        name=name,
        table_spec=table,
        input_shape=[batch, 1],
        output_shape=[batch, table.embedding_dim],
    )


def test_prepare_gives_a_table_its_own_stack():
    # G = 2, S = 4: N = 8; vocab 100 -> multiple of 8 * N = 64 -> 128; dim 12 -> 16.
    table = Table(
        name="t",
        vocabulary_size=100,
        embedding_dim=12,
        combiner="mean",
        max_ids_per_partition=32,
        max_unique_ids_per_partition=16,
        suggested_coo_buffer_size_per_device=1000,
    )
    feature = _feature("f", table)
    (prepared,) = embedding.prepare_feature_specs_for_training([feature], 2, 4)
    assert feature.id_transformation is None  # inputs are left untouched
    assert prepared.id_transformation == embedding.FeatureIdTransformation(0, 0, 0)
    assert prepared.table_spec.setting_in_stack == embedding.TableSettingInStack(
        stack_name="t", padded_vocab_size=128, padded_embedding_dim=16
    )
    assert prepared.table_spec.stacked_table_spec == embedding.StackedTableSpec(
        stack_name="t",
        stack_vocab_size=128,
        stack_embedding_dim=16,
        optimizer=table.optimizer,
        combiner=embedding.Combiner.MEAN,
        total_sample_count=16,
        max_ids_per_partition=32,
        max_unique_ids_per_partition=16,
        suggested_coo_buffer_size_per_device=1000,
    )


def test_feature_stacking_orders_by_name_and_keeps_the_tree():
    # Three features on one table, given out of name order, in a nested tree:
    # samples are concatenated in name order a (8), b (16), c (4).
    table = Table(name="t", vocabulary_size=64)
    specs = {"x": [_feature("c", table, 4), _feature("a", table, 8)], "y": (_feature("b", table),)}
    prepared = embedding.prepare_feature_specs_for_training(specs, 1, 1)
    assert [f.name for f in prepared["x"]] == ["c", "a"]
    assert isinstance(prepared["y"], tuple)
    offsets = {f.name: f.id_transformation.row_offset for f in [*prepared["x"], *prepared["y"]]}
    assert offsets == {"a": 0, "b": 8, "c": 24}
    stacks = embedding.get_stacked_table_specs(prepared)
    assert list(stacks) == ["t"]
    assert stacks["t"].total_sample_count == 28


def test_prepare_is_idempotent():
    table = Table(name="t", vocabulary_size=64)
    specs = {"a": _feature("a", table), "b": _feature("b", table)}
    once = embedding.prepare_feature_specs_for_training(specs, 2, 2)
    assert embedding.prepare_feature_specs_for_training(once, 2, 2) == once


def _three_tables():
    return {
        "f1": _feature("f1", Table(name="t1", vocabulary_size=32, max_ids_per_partition=10)),
        "f2": _feature("f2", Table(name="t2", vocabulary_size=20, max_ids_per_partition=20)),
        "f3": _feature("f3", Table(name="t3", vocabulary_size=70, embedding_dim=4), 8),
    }


def test_stack_tables_offsets_and_rotation():
    # G = S = 2: N = 4, vocabularies padded to multiples of 32: 32, 32, 96.
    # Rows per shard: 8, 8, 24 -> row offsets 0, 8, 16; col_offset = 4 x that.
    # Rotation defaults to S = 2: shard rotations 0, 2, 4 mod 4 = 0.
    # Dims 8, 8, 4 all pad to 8; limits are summed (t3 has the default 256).
    stacked = embedding.stack_tables(_three_tables(), ["t1", "t2", "t3"], 2, 2)
    settings = {f.name: f.table_spec.setting_in_stack for f in stacked.values()}
    assert [(s.row_offset_in_shard, s.shard_rotation) for s in settings.values()] == [
        (0, 0),
        (8, 2),
        (16, 0),
    ]
    assert {s.stack_name for s in settings.values()} == {"t1_t2_t3"}
    assert [s.padded_vocab_size for s in settings.values()] == [32, 32, 96]
    assert [f.id_transformation for f in stacked.values()] == [
        embedding.FeatureIdTransformation(row_offset=0, col_offset=0, col_shift=0),
        embedding.FeatureIdTransformation(row_offset=16, col_offset=32, col_shift=2),
        embedding.FeatureIdTransformation(row_offset=32, col_offset=64, col_shift=0),
    ]
    stack = embedding.get_stacked_table_specs(stacked)["t1_t2_t3"]
    assert stack.stack_vocab_size == 160
    assert stack.stack_embedding_dim == 8
    assert stack.total_sample_count == 40
    assert stack.max_ids_per_partition == 10 + 20 + 256
    assert stack.suggested_coo_buffer_size_per_device is None  # one table has none


def test_stack_tables_custom_rotation_name_and_order():
    # Order t2, t1 with rotation 3 on N = 4: t2 rotation 0, t1 rotation 3.
    stacked = embedding.stack_tables(
        _three_tables(), ["t2", "t1"], 2, 2, rotation=3, stack_name="pair"
    )
    t1 = stacked["f1"].table_spec.setting_in_stack
    assert (t1.stack_name, t1.row_offset_in_shard, t1.shard_rotation) == ("pair", 8, 3)
    # Features keep the tree's order for their samples: f1 first.
    assert stacked["f1"].id_transformation == embedding.FeatureIdTransformation(0, 32, 3)
    assert stacked["f2"].id_transformation == embedding.FeatureIdTransformation(16, 0, 0)
    # t3 is untouched by stack_tables, and gets its own stack on preparing.
    assert not stacked["f3"].table_spec.is_stacked()
    prepared = embedding.prepare_feature_specs_for_training(stacked, 2, 2)
    assert prepared["f1"] == stacked["f1"]
    assert list(embedding.get_stacked_table_specs(prepared)) == ["pair", "t3"]


def test_stacked_summed_suggested_buffer():
    t1 = Table(name="t1", vocabulary_size=8, suggested_coo_buffer_size_per_device=48)
    t2 = Table(name="t2", vocabulary_size=8, suggested_coo_buffer_size_per_device=16)
    specs = [_feature("a", t1), _feature("b", t2)]
    stacked = embedding.stack_tables(specs, ["t1", "t2"], 1, 1)
    assert stacked[0].table_spec.stacked_table_spec.suggested_coo_buffer_size_per_device == 64


def test_get_stacked_table_specs_needs_prepared_specs():
    with pytest.raises(ValueError, match="Feature 'f1' is not prepared"):
        embedding.get_stacked_table_specs(_three_tables())


@pytest.mark.parametrize(
    ("tables", "message"),
    [
        (["t1", "nope"], "unknown table 'nope'"),
        ([], "table_names is empty"),
        (["t1", "t1"], "a table is named twice"),
    ],
)
def test_stack_tables_bad_names(tables, message):
    with pytest.raises(ValueError, match=message):
        embedding.stack_tables(_three_tables(), tables, 1, 1)


def test_stack_tables_rejects_an_already_stacked_table():
    stacked = embedding.stack_tables(_three_tables(), ["t1", "t2"], 1, 1)
    with pytest.raises(ValueError, match="table 't1' is already in a stack"):
        embedding.stack_tables(stacked, ["t1", "t3"], 1, 1)


@pytest.mark.parametrize(
    ("other", "what"),
    [
        ({"embedding_dim": 16}, "padded embedding dim"),
        ({"optimizer": embedding.AdagradOptimizerSpec()}, "optimizer"),
        ({"optimizer": embedding.SGDOptimizerSpec(learning_rate=0.5)}, "optimizer"),
        ({"combiner": "mean"}, "combiner"),
    ],
)
def test_stack_tables_needs_same_dim_optimizer_combiner(other, what):
    specs = [
        _feature("a", Table(name="t1", vocabulary_size=8)),
        _feature("b", Table(name="t2", vocabulary_size=8, **other)),
    ]
    with pytest.raises(ValueError, match=f"their {what} differs"):
        embedding.stack_tables(specs, ["t1", "t2"], 1, 1)


@pytest.mark.parametrize(
    "stacking",
    [
        lambda specs: embedding.prepare_feature_specs_for_training(specs, 1, 1),
        lambda specs: embedding.stack_tables(specs, ["t"], 1, 1),
    ],
    ids=["prepare", "stack_tables"],
)
def test_duplicate_feature_names(stacking):
    table = Table(name="t", vocabulary_size=8)
    with pytest.raises(ValueError, match="Two features are named 'f'"):
        stacking([_feature("f", table), _feature("f", table)])


def test_same_table_name_with_different_specs():
    specs = [
        _feature("a", Table(name="t", vocabulary_size=8)),
        _feature("b", Table(name="t", vocabulary_size=9)),
    ]
    with pytest.raises(ValueError, match="Two different tables are named 't'"):
        embedding.prepare_feature_specs_for_training(specs, 1, 1)


@pytest.mark.parametrize(("global_", "slots"), [(3, 1), (2, 3), (6, 4)])
def test_partition_count_must_be_a_power_of_two(global_, slots):
    with pytest.raises(ValueError, match="must be a power of two"):
        embedding.prepare_feature_specs_for_training(_three_tables(), global_, slots)


def test_non_feature_leaves_are_rejected():
    with pytest.raises(TypeError, match="Expected FeatureSpec leaves"):
        embedding.prepare_feature_specs_for_training({"f": "not a spec"}, 1, 1)


def _stack_names(specs):
    return {
        f.name: (f.table_spec.stacked_table_spec.stack_name if f.table_spec.is_stacked() else None)
        for f in specs
    }


def test_auto_stack_groups_by_padded_dim_optimizer_and_combiner():
    # Padded dims: 12 and 16 -> 16 (same group), 4 -> 8. Groups in first-use order.
    adagrad = embedding.AdagradOptimizerSpec(learning_rate=0.1)
    tables = {
        "u": Table(name="u", vocabulary_size=64, embedding_dim=16),
        "v": Table(name="v", vocabulary_size=64, embedding_dim=4),
        "w": Table(name="w", vocabulary_size=64, embedding_dim=12),
        "x": Table(name="x", vocabulary_size=64, embedding_dim=16, optimizer=adagrad),
        "y": Table(name="y", vocabulary_size=64, embedding_dim=16, combiner="mean"),
        "z": Table(name="z", vocabulary_size=64, embedding_dim=16),
        "k": Table(name="k", vocabulary_size=64, embedding_dim=4),
    }
    features = [_feature(f"f{name}", table) for name, table in tables.items()]
    features.append(_feature("fu2", tables["u"]))
    stacked = embedding.auto_stack_tables(features, 2, 4)
    assert _stack_names(stacked) == {
        "fu": "u_w_z",
        "fv": "v_k",
        "fw": "u_w_z",
        "fx": None,
        "fy": None,
        "fz": "u_w_z",
        "fk": "v_k",
        "fu2": "u_w_z",
    }
    # The same as stacking the groups by hand.
    by_hand = embedding.stack_tables(features, ["u", "w", "z"], 2, 4)
    by_hand = embedding.stack_tables(by_hand, ["v", "k"], 2, 4)
    assert stacked == by_hand


def test_auto_stack_leaves_stacked_tables_and_shortens_long_names():
    names = [f"table_number_{i:02d}" for i in range(10)]  # joined: 159 characters
    tables = [Table(name=name, vocabulary_size=64) for name in names]
    features = [_feature(f"f{i}", t) for i, t in enumerate(tables)]
    features = embedding.stack_tables(features, names[:2], 1, 2)
    stacked = embedding.auto_stack_tables(features, 1, 2)
    assert _stack_names(stacked) == {
        "f0": "table_number_00_table_number_01",
        "f1": "table_number_00_table_number_01",
        **{f"f{i}": "table_number_02_to_table_number_09_8_tables" for i in range(2, 10)},
    }


def test_auto_stack_leaves_a_lone_table_alone():
    (feature,) = embedding.auto_stack_tables(
        [_feature("f", Table(name="t", vocabulary_size=8))], 1, 1
    )
    assert not feature.table_spec.is_stacked()
