"""The training stages: stacking of per-feature activations and gradients, the step's
XLA options, and the dense step computed per device."""

import dataclasses
import re
from types import SimpleNamespace

import jax
import numpy as np
import pytest
import yaml
from jax.sharding import NamedSharding, PartitionSpec
from train_cases import small_demo_config

import embedding
import parallel
from sparseflow import _dense_model, _model, _steps, _train, load_config
from sparseflow._errors import UsageError


def _stages(dims: dict[str, int]) -> _steps.Stages:
    specs = {
        name: SimpleNamespace(table_spec=SimpleNamespace(embedding_dim=d))
        for name, d in dims.items()
    }
    return _steps.Stages(specs, mesh=None, optimizer=None, enable_minibatching=False)


def test_stack_puts_features_side_by_side_in_name_order_and_unstack_inverts_it():
    dims = {"query": 3, "ad": 2, "user": 4, "geo": 2}
    stages = _stages(dims)
    rng = np.random.default_rng(0)
    per_feature = {name: rng.normal(size=(6, d)).astype(np.float32) for name, d in dims.items()}

    stacked = np.asarray(stages.stack(per_feature))
    expected = np.concatenate(
        [per_feature[name] for name in ("ad", "geo", "query", "user")], axis=1
    )
    np.testing.assert_array_equal(stacked, expected)

    back = stages.unstack(stacked)
    assert sorted(back) == sorted(dims)
    for name, value in per_feature.items():
        np.testing.assert_array_equal(np.asarray(back[name]), value)


def _mesh_stages(devices) -> _steps.Stages:
    mesh = jax.sharding.Mesh(np.array(devices), ("devices",))
    return _steps.Stages({}, mesh=mesh, optimizer=None, enable_minibatching=False)


@pytest.mark.parametrize(
    "cores, devices, scheduler_off", [(2, 8, True), (8, 8, False), (2, 1, False)]
)
def test_the_concurrency_scheduler_is_off_where_the_devices_outnumber_the_cores(
    monkeypatch, cores, devices, scheduler_off
):
    monkeypatch.setattr(_steps, "_usable_cores", lambda: cores)
    options = _mesh_stages(jax.devices()[:devices]).step_compiler_options
    expected = {"xla_cpu_enable_concurrency_optimized_scheduler": False} if scheduler_off else None
    assert options == expected


@pytest.mark.parametrize(
    ("pipeshard", "driver"), [(None, "jit_step"), ("a pipeline", "host_driven_step")]
)
def test_the_pipelined_step_is_compiled_with_the_stages_options(monkeypatch, pipeshard, driver):
    """Pipeshard's host-driven step too: its sparse program runs on every device."""
    given = {}
    monkeypatch.setattr(parallel, driver, lambda *stage_functions, **options: given.update(options))
    stages = SimpleNamespace(
        pipeshard=pipeshard,
        sc_fwd="sc_fwd",
        tc="tc",
        pipeshard_tc="pipeshard_tc",
        sc_bwd="sc_bwd",
        step_compiler_options={"an_option": False},
    )
    _train._pipelined_step(stages)
    assert given == {"compiler_options": {"an_option": False}}


def _demo(tmp_path, model: dict | None = None):
    """The demo config (8 devices) and its mesh, with `model` in place of its own."""
    path = small_demo_config(tmp_path, {"log_every": 2})
    if model is not None:
        raw = yaml.safe_load(path.read_text())
        raw["model"] = model
        path.write_text(yaml.safe_dump(raw))
    config = load_config(path)
    return config, _train.make_mesh(config.mesh.devices)


def _not_a_mean(logits, labels):
    return (logits**2).sum()


@pytest.mark.parametrize(
    ("model", "loss", "expected"),
    [
        (None, None, True),
        ({"tower": {"type": "dcn_v2", "cross_layers": 2, "mlp": [8]}}, None, True),
        (None, _not_a_mean, False),
        ({"module": "user_models:LinearModel"}, None, False),
        ({"module": "user_models:LinearMeanOverExamples"}, None, True),
        ({"module": "user_models:LinearMeanOverExamples"}, _not_a_mean, False),
    ],
)
def test_a_model_is_a_mean_over_examples_where_its_class_says_so_of_its_own_loss(
    tmp_path, model, loss, expected
):
    """The shipped towers say so; a user's model may tie examples together (a
    batch statistic, an in-batch softmax), and a loss given in place of the
    class's need not be a mean."""
    config, mesh = _demo(tmp_path, model)
    assert _dense_model.dense_model(config, mesh, loss=loss).mean_over_examples is expected


def test_a_mean_over_examples_other_than_true_or_false_is_refused(tmp_path):
    config, mesh = _demo(tmp_path, {"module": "user_models:MeanOverExamplesNotABool"})
    with pytest.raises(UsageError, match=re.escape("its mean_over_examples must be True or False")):
        _dense_model.dense_model(config, mesh)


def _dense_batch(config, rng):
    """`(dense, activations, labels)` of a global batch, drawn at random."""
    batch = config.global_batch_size
    dense = rng.normal(size=(batch, config.layout.num_dense_features)).astype(np.float32)
    activations = {
        name: rng.normal(size=(batch, dim)).astype(np.float32)
        for name, dim in embedding.feature_dims(config.feature_specs).items()
    }
    labels = rng.integers(0, 2, size=batch).astype(np.int32)
    return dense, activations, labels


def test_the_dense_step_per_device_is_the_whole_batchs(tmp_path):
    config, mesh = _demo(tmp_path)
    model = _dense_model.dense_model(config, mesh)
    stages = _steps.Stages({}, mesh, optimizer=None, enable_minibatching=False, dense_model=model)
    params = model.init(jax.random.key(1))
    dense, activations, labels = _dense_batch(config, np.random.default_rng(0))
    value_and_grad = jax.value_and_grad(stages._loss, argnums=(0, 2), has_aux=True)

    # The reference: the whole batch on one device.
    one = jax.devices()[0]
    want = jax.jit(value_and_grad)(*jax.device_put((params, dense, activations, labels), one))

    by_example = NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))
    got = jax.jit(_steps._mean_of_device_parts(value_and_grad, mesh))(
        jax.device_put(params, NamedSharding(mesh, PartitionSpec())),
        *jax.device_put((dense, activations, labels), by_example),
    )
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("mean_over_examples", [True, False])
def test_the_dense_stage_sums_in_one_flat_all_reduce_where_the_model_is_a_mean_over_examples(
    tmp_path, mean_over_examples
):
    """Otherwise XLA partitions it, and sums each gradient as an array of its own."""
    config, mesh = _demo(tmp_path)
    model = _dense_model.dense_model(config, mesh)
    model = dataclasses.replace(model, mean_over_examples=mean_over_examples)
    optimizer = _model.dense_optimizer(config.model)
    specs = {
        name: SimpleNamespace(table_spec=SimpleNamespace(embedding_dim=d))
        for name, d in embedding.feature_dims(config.feature_specs).items()
    }
    stages = _steps.Stages(specs, mesh, optimizer, enable_minibatching=False, dense_model=model)
    state = _steps.init_train_state(jax.random.key(1), model, optimizer, mesh)
    dense, activations, labels = _dense_batch(config, np.random.default_rng(0))
    by_example = NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))
    inputs = jax.device_put(
        (stages.stack(activations), _steps.DenseInputs(dense, labels)), by_example
    )
    program = jax.jit(stages.tc).lower(*inputs, state, None).compile().as_text()
    all_reduces = re.findall(r"= (\S+|\(.*?\)) all-reduce\(", program)
    params = 1 + sum(leaf.size for leaf in jax.tree.leaves(state.params))
    if mean_over_examples:
        assert all_reduces == [f"f32[{params}]{{0}}"]
    else:
        assert len(all_reduces) == 1 and all_reduces[0].count("f32[") > 2
