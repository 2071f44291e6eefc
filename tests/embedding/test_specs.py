"""TableSpec, FeatureSpec, optimizer specs and initializers: validation and values."""

import dataclasses
import functools
import pickle

import jax
import numpy as np
import pytest

import embedding
from embedding import initializers

Table = functools.partial(
    embedding.TableSpec,
    name="t",
    vocabulary_size=100,
    embedding_dim=8,
    initializer=initializers.Constant(0.0),
    optimizer=embedding.SGDOptimizerSpec(),
    combiner="sum",
)


def _feature(**overrides) -> embedding.FeatureSpec:
    fields = dict(name="f", table_spec=Table(), input_shape=[16, 3], output_shape=[16, 8])
    return embedding.FeatureSpec(**(fields | overrides))


def test_table_spec_defaults_and_combiner_coercion():
    table = Table(combiner="mean")
    assert table.combiner is embedding.Combiner.MEAN
    assert table.max_ids_per_partition == table.max_unique_ids_per_partition == 256
    assert table.suggested_coo_buffer_size_per_device is None
    assert not table.is_stacked()
    assert Table(combiner=embedding.Combiner.SQRTN).combiner is embedding.Combiner.SQRTN


def test_combiner_values():
    assert [c.value for c in embedding.Combiner] == ["sum", "mean", "sqrtn"]


@pytest.mark.parametrize(
    "field",
    [
        "vocabulary_size",
        "embedding_dim",
        "max_ids_per_partition",
        "max_unique_ids_per_partition",
        "suggested_coo_buffer_size_per_device",
    ],
)
@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_table_spec_sizes_must_be_positive_integers(field, bad):
    with pytest.raises(ValueError, match=f"TableSpec 't': {field} must be a positive integer"):
        Table(**{field: bad})


@pytest.mark.parametrize("bad", ["max", "SUM", "", None])
def test_table_spec_bad_combiner(bad):
    with pytest.raises(ValueError, match="combiner must be one of sum, mean, sqrtn"):
        Table(combiner=bad)


@pytest.mark.parametrize("bad", ["sgd", None, embedding.SGDOptimizerSpec])
def test_table_spec_optimizer_must_be_an_optimizer_spec(bad):
    with pytest.raises(TypeError, match="optimizer must be an OptimizerSpec"):
        Table(optimizer=bad)


def test_table_spec_initializer_must_be_callable():
    with pytest.raises(TypeError, match="initializer must be callable"):
        Table(initializer=0.0)


@pytest.mark.parametrize("bad", ["", None, 3])
def test_table_spec_name(bad):
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        Table(name=bad)


def test_specs_are_frozen_and_keyword_only():
    table = Table()
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.vocabulary_size = 5
    with pytest.raises(TypeError):
        embedding.TableSpec(
            "t", 10, 8, initializers.Constant(), embedding.SGDOptimizerSpec(), "sum"
        )


def test_feature_spec_shapes():
    feature = _feature()
    assert feature.input_shape == (16, 3)
    assert feature.output_shape == (16, 8)
    assert feature.global_batch_size == 16
    assert feature.id_transformation is None
    assert _feature(input_shape=[16]).input_shape == (16,)  # ragged: no valency


def test_feature_spec_output_dim_must_equal_table_dim():
    with pytest.raises(ValueError, match=r"output_shape\[1\] = 4 must equal the embedding_dim 8"):
        _feature(output_shape=[16, 4])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"output_shape": [8, 8]}, "input_shape batch 16 differs from output_shape batch 8"),
        ({"input_shape": [16, 3, 2]}, "input_shape must be"),
        ({"input_shape": []}, "input_shape must be"),
        ({"output_shape": [16]}, "output_shape must be"),
        ({"input_shape": [0, 3], "output_shape": [0, 8]}, "global batch"),
        ({"name": ""}, "name must be a non-empty string"),
    ],
)
def test_feature_spec_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        _feature(**overrides)


def test_feature_spec_table_must_be_a_table_spec():
    with pytest.raises(TypeError, match="table_spec must be a TableSpec"):
        _feature(table_spec="t")


@pytest.mark.parametrize(
    ("spec", "slots", "shapes"),
    [
        (embedding.SGDOptimizerSpec(), embedding.SGDSlots(), embedding.SGDSlots()),
        (
            embedding.AdagradOptimizerSpec(initial_accumulator_value=0.5),
            embedding.AdagradSlots(accumulator=0.5),
            embedding.AdagradSlots(accumulator=(64, 8)),
        ),
        (
            embedding.RowWiseAdagradOptimizerSpec(initial_accumulator_value=0.5),
            embedding.RowWiseAdagradSlots(accumulator=0.5),
            embedding.RowWiseAdagradSlots(accumulator=(64,)),
        ),
        (
            embedding.AdamOptimizerSpec(),
            embedding.AdamSlots(momentum=0.0, velocity=0.0),
            embedding.AdamSlots(momentum=(64, 8), velocity=(64, 8)),
        ),
        (
            embedding.FTRLOptimizerSpec(initial_accumulator_value=0.2, initial_linear_value=-1),
            embedding.FTRLSlots(accumulator=0.2, linear=-1.0),
            embedding.FTRLSlots(accumulator=(64, 8), linear=(64, 8)),
        ),
    ],
)
def test_optimizer_slots(spec, slots, shapes):
    assert isinstance(spec, embedding.OptimizerSpec)
    initial = spec.slot_initial_values()
    assert type(initial) is type(slots) is spec.slots_type
    assert initial == slots
    assert spec.slot_shapes(64, 8) == shapes


def test_a_misspelt_slot_is_an_attribute_error():
    with pytest.raises(AttributeError):
        _ = embedding.AdagradOptimizerSpec().slot_initial_values().accumulater


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"initial_accumulator_value": -1.0}, "initial_accumulator_value must be finite"),
        ({"epsilon": float("nan")}, "epsilon must be finite"),
        ({"initial_accumulator_value": 0.0, "epsilon": 0.0}, "both 0"),
    ],
)
def test_rowwise_adagrad_rejects_bad_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        embedding.RowWiseAdagradOptimizerSpec(**kwargs)


def test_optimizer_positional_arguments_follow_the_reference_order():
    adagrad = embedding.AdagradOptimizerSpec(0.5, 0.25)
    assert (adagrad.learning_rate, adagrad.initial_accumulator_value) == (0.5, 0.25)
    adam = embedding.AdamOptimizerSpec(0.01, 0.8, 0.9, 1e-6)
    assert (adam.beta_1, adam.beta_2, adam.epsilon) == (0.8, 0.9, 1e-6)
    ftrl = embedding.FTRLOptimizerSpec(0.1, -0.25, 0.01, 0.02)
    assert (ftrl.learning_rate_power, ftrl.l1_regularization_strength) == (-0.25, 0.01)
    assert ftrl.l2_regularization_strength == 0.02


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: embedding.AdamOptimizerSpec(beta_1=1.0), "beta_1 must be in"),
        (lambda: embedding.AdamOptimizerSpec(beta_1=1.5), "beta_1 must be in"),
        (lambda: embedding.AdamOptimizerSpec(beta_2=-0.1), "beta_2 must be in"),
        (lambda: embedding.AdamOptimizerSpec(epsilon=-1e-8), "epsilon must be finite"),
        (lambda: embedding.AdagradOptimizerSpec(initial_accumulator_value=0.0), "> 0"),
        (lambda: embedding.AdagradOptimizerSpec(initial_accumulator_value=-1), "> 0"),
        (lambda: embedding.FTRLOptimizerSpec(learning_rate_power=0.5), "learning_rate_power"),
        (lambda: embedding.FTRLOptimizerSpec(l1_regularization_strength=-1), "l1_regular"),
        (lambda: embedding.FTRLOptimizerSpec(l2_regularization_strength=-1), "l2_regular"),
        (lambda: embedding.FTRLOptimizerSpec(beta=-0.1), "beta must be finite"),
        (lambda: embedding.FTRLOptimizerSpec(initial_accumulator_value=0), "> 0"),
        (lambda: embedding.SGDOptimizerSpec(learning_rate=-0.1), "learning_rate"),
        (lambda: embedding.SGDOptimizerSpec(learning_rate=float("nan")), "learning_rate"),
        (lambda: embedding.AdagradOptimizerSpec(learning_rate=float("inf")), "learning_rate"),
    ],
)
def test_optimizer_validation(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_get_learning_rate_constant():
    assert embedding.SGDOptimizerSpec(learning_rate=0.25).get_learning_rate() == 0.25
    assert embedding.SGDOptimizerSpec(learning_rate=0.25).get_learning_rate(step=7) == 0.25


def test_get_learning_rate_schedule_of_the_step():
    spec = embedding.AdamOptimizerSpec(learning_rate=lambda step: 0.1 / (1 + step))
    assert spec.get_learning_rate(step=4) == pytest.approx(0.02)
    assert float(spec.get_learning_rate(step=np.int32(9))) == pytest.approx(0.01)
    with pytest.raises(ValueError, match="takes the step; pass `step`"):
        spec.get_learning_rate()


def test_get_learning_rate_schedule_without_arguments():
    spec = embedding.AdagradOptimizerSpec(learning_rate=lambda: 0.3)
    assert spec.get_learning_rate() == 0.3
    assert spec.get_learning_rate(step=5) == 0.3


@pytest.mark.parametrize(
    "init",
    [
        initializers.Constant(0.5),
        initializers.Normal(stddev=0.1),
        initializers.TruncatedNormal(stddev=0.1),
        initializers.Uniform(scale=0.1),
    ],
)
def test_initializers_pickle_and_compare(init):
    assert pickle.loads(pickle.dumps(init)) == init
    assert hash(init) == hash(dataclasses.replace(init))
    values = init(jax.random.key(0), (64, 8), jax.numpy.float32)
    assert values.shape == (64, 8) and values.dtype == jax.numpy.float32


def test_initializer_value_ranges():
    key = jax.random.key(1)
    np.testing.assert_array_equal(initializers.Constant(0.5)(key, (3, 2)), np.full((3, 2), 0.5))
    uniform = np.asarray(initializers.Uniform(scale=0.1)(key, (4096,)))
    assert uniform.min() >= -0.1 and uniform.max() < 0.1
    truncated = np.asarray(initializers.TruncatedNormal(stddev=0.1)(key, (4096,)))
    assert np.abs(truncated).max() <= 0.2 + 1e-6
    normal = np.asarray(initializers.Normal(stddev=0.1, mean=2.0)(key, (4096,)))
    assert abs(normal.mean() - 2.0) < 0.01 and abs(normal.std() - 0.1) < 0.01
