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
        (
            embedding.LaPropOptimizerSpec(initial_slot_value=0.25),
            embedding.LaPropSlots(mu=0.25, nu=0.25),
            embedding.LaPropSlots(mu=(64, 8), nu=(64, 8)),
        ),
        (
            embedding.AdagradMomentumOptimizerSpec(
                initial_accumulator_value=0.3, initial_momentum_value=0.1
            ),
            embedding.AdagradMomentumSlots(accumulator=0.3, momentum=0.1),
            embedding.AdagradMomentumSlots(accumulator=(64, 8), momentum=(64, 8)),
        ),
        (
            embedding.F2AOptimizerSpec(initial_accumulator_value=0.2, initial_local_step_value=3),
            embedding.F2ASlots(accumulator=0.2, local_step=3.0),
            embedding.F2ASlots(accumulator=(64, 8), local_step=(64, 8)),
        ),
        (
            embedding.RowWiseAdamOptimizerSpec(),
            embedding.RowWiseAdamSlots(momentum=0.0, velocity=0.0),
            embedding.RowWiseAdamSlots(momentum=(64, 8), velocity=(64,)),
        ),
    ],
)
def test_optimizer_slots(spec, slots, shapes):
    assert isinstance(spec, embedding.OptimizerSpec)
    initial = spec.slot_initial_values()
    assert type(initial) is type(slots) is spec.slots_type
    assert initial == slots
    assert spec.slot_shapes(64, 8) == shapes
    initializers_ = spec.slot_variables_initializers()
    assert type(initializers_) is spec.slots_type
    for init, value in zip(initializers_, slots, strict=True):
        np.testing.assert_array_equal(init(jax.random.key(0), (2, 3)), np.full((2, 3), value, "f4"))


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        (embedding.SGDOptimizerSpec(), "sgd"),
        (embedding.AdagradOptimizerSpec(), "adagrad"),
        (embedding.RowWiseAdagradOptimizerSpec(), "rowwise_adagrad"),
        (embedding.AdamOptimizerSpec(), "adam"),
        (embedding.FTRLOptimizerSpec(), "ftrl"),
        (embedding.LaPropOptimizerSpec(), "laprop"),
        (embedding.AdagradMomentumOptimizerSpec(), "adagrad_momentum"),
        (embedding.F2AOptimizerSpec(), "f2a"),
        (embedding.RowWiseAdamOptimizerSpec(), "rowwise_adam"),
    ],
)
def test_optimizer_short_name(spec, name):
    assert spec.short_name() == name == spec.config_type


def _schedule(step):
    return 1.0 - 0.01 * step


def _f32(*values) -> tuple:
    return tuple(np.float32(v) for v in values)


@pytest.mark.parametrize(
    ("spec", "step", "expected"),
    [
        (embedding.SGDOptimizerSpec(learning_rate=_schedule), 10, _f32(0.9)),
        (embedding.RowWiseAdagradOptimizerSpec(learning_rate=0.3), None, _f32(0.3)),
        (
            embedding.FTRLOptimizerSpec(_schedule, -0.25, 0.01, 0.02, 0.5),
            0,
            _f32(1.0, -0.25, 0.01, 0.02, 0.5),
        ),
        (
            embedding.AdamOptimizerSpec(_schedule, beta_1=0.5, beta_2=0.75, epsilon=0.1),
            1,
            # t = 2: alpha_t = 0.99 * sqrt(1 - 0.75^2) / (1 - 0.5^2)
            _f32(0.99 * np.sqrt(0.4375) / 0.75, 0.5, 0.75, 0.1 * np.sqrt(0.4375)),
        ),
        (
            embedding.LaPropOptimizerSpec(_schedule, b1=0.8, b2=0.5, eps=1e-6),
            2,
            # decay = b2 (1 - b2^2) / (1 - b2^3)
            _f32(0.98, 0.8, 0.5 * 0.75 / 0.875, 1e-6),
        ),
        (embedding.LaPropOptimizerSpec(0.1, b2=0.5), None, _f32(0.1, 0.9, 0.5, 1e-30)),
        (embedding.LaPropOptimizerSpec(0.1, b2=0.5), 0, _f32(0.1, 0.9, 0.0, 1e-30)),
        (
            embedding.AdagradMomentumOptimizerSpec(_schedule, 0.7, 0.9, 1e-4, 3.0, True),
            5,
            (*_f32(0.95, 0.7, 0.9, 1e-4, 3.0), np.True_),
        ),
        (
            embedding.F2AOptimizerSpec(
                _schedule,
                rho=0.25,
                l1_regularization_strength=0.01,
                l2_regularization_strength=0.02,
                max_lr_multiplier=8,
            ),
            7,
            _f32(0.93, 0.25, 0.01, 0.02, 8, 7),
        ),
        (embedding.F2AOptimizerSpec(0.5), None, _f32(0.5, 0.5, 0, 0, 1e6, 0)),
        (
            embedding.RowWiseAdamOptimizerSpec(_schedule, 0.5, 0.75, 0.1, 0.01),
            4,
            _f32(0.96, 0.5, 0.75, 0.1, 0.01, 5),
        ),
        (embedding.RowWiseAdamOptimizerSpec(0.2), None, _f32(0.2, 0.9, 0.999, 1e-8, 0, 1)),
    ],
)
def test_optimizer_hyperparameters(spec, step, expected):
    """In jax-tpu-embedding's order, float32 (bool for Nesterov) scalars."""
    actual = spec.get_hyperparameters(step)
    assert [np.asarray(a).dtype for a in actual] == [np.asarray(e).dtype for e in expected]
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=1e-6)


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
    laprop = embedding.LaPropOptimizerSpec(0.1, 0.8, 0.9, 1e-6, None, 0.5)
    assert (laprop.b1, laprop.b2, laprop.eps, laprop.initial_slot_value) == (0.8, 0.9, 1e-6, 0.5)
    momentum = embedding.AdagradMomentumOptimizerSpec(0.1, 0.8, 0.9, 1e-6, 3.0, True, 0.2, 0.1)
    assert (momentum.momentum, momentum.beta2, momentum.epsilon) == (0.8, 0.9, 1e-6)
    assert (momentum.exponent, momentum.use_nesterov) == (3.0, True)
    assert (momentum.initial_accumulator_value, momentum.initial_momentum_value) == (0.2, 0.1)
    f2a = embedding.F2AOptimizerSpec(0.1, 0.6, 0.2, 1.0, 0.01, 0.02, 100.0)
    assert (f2a.rho, f2a.initial_accumulator_value, f2a.initial_local_step_value) == (0.6, 0.2, 1)
    assert (f2a.l1_regularization_strength, f2a.l2_regularization_strength) == (0.01, 0.02)
    assert f2a.max_lr_multiplier == 100.0


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
        (lambda: embedding.LaPropOptimizerSpec(b1=1.0), "b1 must be in"),
        (lambda: embedding.LaPropOptimizerSpec(b2=-0.5), "b2 must be in"),
        (lambda: embedding.LaPropOptimizerSpec(eps=0.0), "eps must be finite and > 0"),
        (lambda: embedding.LaPropOptimizerSpec(rms_clip_threshold=1.0), "rms_clip_threshold"),
        (lambda: embedding.LaPropOptimizerSpec(initial_slot_value=-1), "initial_slot_value"),
        (lambda: embedding.AdagradMomentumOptimizerSpec(beta2=0.0), r"beta2 must be in \(0, 1\]"),
        (lambda: embedding.AdagradMomentumOptimizerSpec(beta2=1.5), r"beta2 must be in"),
        (lambda: embedding.AdagradMomentumOptimizerSpec(exponent=0), "exponent must be"),
        (lambda: embedding.AdagradMomentumOptimizerSpec(momentum=-0.1), "momentum must be"),
        (
            lambda: embedding.AdagradMomentumOptimizerSpec(initial_accumulator_value=0, epsilon=0),
            "both 0",
        ),
        (lambda: embedding.F2AOptimizerSpec(initial_accumulator_value=0), "> 0"),
        (lambda: embedding.F2AOptimizerSpec(rho=-1), "rho must be"),
        (lambda: embedding.F2AOptimizerSpec(max_lr_multiplier=0), "max_lr_multiplier"),
        (lambda: embedding.F2AOptimizerSpec(l1_regularization_strength=-1), "l1_regular"),
        (lambda: embedding.RowWiseAdamOptimizerSpec(beta_1=1.0), "beta_1 must be in"),
        (lambda: embedding.RowWiseAdamOptimizerSpec(beta_2=-0.1), "beta_2 must be in"),
        (lambda: embedding.RowWiseAdamOptimizerSpec(epsilon=-1), "epsilon must be finite"),
        (lambda: embedding.RowWiseAdamOptimizerSpec(weight_decay=-1), "weight_decay must be"),
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


def test_feature_dims_are_each_feature_s_table_width_in_the_given_order():
    wide = Table(name="wide", embedding_dim=12)
    specs = {
        "z": _feature(name="z"),
        "a": _feature(name="a", table_spec=wide, output_shape=[16, 12]),
    }
    assert list(embedding.feature_dims(specs).items()) == [("z", 8), ("a", 12)]
