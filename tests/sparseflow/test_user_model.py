"""`model.module`: the trainer runs a user's Flax NNX model built on `embedding.nnx.Embed`."""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import user_models
import yaml
from train_cases import assert_resume_is_exact

import embedding
import sparseflow
from sparseflow import _dense_model, _eval_metrics, _in_flight, _model, _train, load_config, towers
from sparseflow._errors import UsageError
from sparseflow.config._checker import ConfigError


def _config(small_run, name: str, model: dict, **training):
    """The small run's config with `model` and the `training` keys given."""
    tmp, path, _, _ = small_run
    raw = yaml.safe_load(path.read_text())
    raw["model"] = model
    raw["training"].update(training)
    out = tmp / f"{name}.yaml"
    out.write_text(yaml.safe_dump(raw))
    return load_config(out)


def _first_batch(config, data: str, tables, index: int = 0, training: bool = True):
    """Global batch `index` of the run (of its evaluation if not `training`) and its
    activations under `tables` (the run's own lookup)."""
    options = _train.TrainOptions(data=data, progress=False)
    mesh = _train.make_mesh(config.mesh.devices)
    specs = _train._feature_specs(config, options, mesh)
    batch = _in_flight.read_batch(
        data,
        _train._batching(config, training=training),
        _train._preprocess_config(config, options, specs, mesh),
        mesh,
        index,
    )
    activations = embedding.sparse_dense_matmul(batch.sparse.unpack(), tables, specs, mesh)
    return batch, {name: np.asarray(a, np.float64) for name, a in activations.items()}


def _first_batch_logits(
    config, data: str, params, tables, index: int = 0, training: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Float64 numpy logits and labels of global batch `index` (`_first_batch`) under
    `params` and `tables`: the activations of the run's own lookup, then the model's
    linear head."""
    batch, activations = _first_batch(config, data, tables, index, training)
    x = np.concatenate(
        [activations[name] for name in sorted(activations)] + [np.asarray(batch.dense, np.float64)],
        axis=1,
    )
    head = params["head"]
    w = np.asarray(head["kernel"][...], np.float64)
    b = np.asarray(head["bias"][...], np.float64)
    return (x @ w + b)[:, 0], np.asarray(batch.labels, np.float64)


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_user_model_trains_and_its_first_loss_is_its_own_forward(small_run, pipelined):
    _, _, _, data = small_run
    config = _config(
        small_run, "linear", {"module": "user_models:LinearModel", "args": {"scale": 0.5}}
    )
    options = _train.TrainOptions(data=data, steps=4, progress=False, pipelined=pipelined)
    mesh = _train.make_mesh(config.mesh.devices)
    run = _train._Run(config, options, mesh)
    initial_params, initial_tables = run.state.params, run.tables
    result = _train.train(config, options)
    assert len(result.losses) == 4 and all(np.isfinite(result.losses))

    z, y = _first_batch_logits(config, data, initial_params, initial_tables)
    z = 0.5 * z
    expected = np.mean(np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z))))
    np.testing.assert_allclose(result.losses[0], expected, rtol=1e-5)
    # The head and the tables moved; the tables keep their row sharding.
    assert not np.array_equal(
        np.asarray(result.train_state.params["head"]["kernel"][...]),
        np.asarray(initial_params["head"]["kernel"][...]),
    )
    for name, variables in result.embedding_variables.items():
        assert variables.table.sharding == initial_tables[name].table.sharding


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"module": "no_such_package.models:Model"}, "cannot import 'no_such_package.models'"),
        ({"module": "user_models:Missing"}, "user_models has no 'Missing'"),
        ({"module": "user_models:LinearModel", "args": {"width": 3}}, "unexpected keyword"),
        ({"module": "user_models:WithoutTheLayer"}, "must hold the Embed layer it is given"),
        ({"module": "user_models:ColumnLogits"}, "must return logits float[batch]"),
        ({"module": "user_models:WithBatchStats"}, "holds variables of type BatchStat"),
        (
            {"module": "user_models:PairLogitsVectorLoss"},
            "its loss(outputs, labels) must return a float scalar, got float32[512]",
        ),
        (
            {"module": "user_models:PairLogitsMismatchedLoss"},
            "its loss(outputs, labels) failed on outputs float32[512, 512] and labels int32[512]",
        ),
    ],
)
def test_a_model_the_trainer_cannot_run_is_refused_naming_why(small_run, model, message):
    config = _config(small_run, "refused", model)
    mesh = _train.make_mesh(config.mesh.devices)
    with pytest.raises(UsageError, match=re.escape(message)):
        _dense_model.dense_model(config, mesh)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"module": "user_models.LinearModel"}, 'must be "package.module:Class"'),
        ({"module": "user_models:LinearModel", "bottom_mlp": [8]}, "configures the shipped"),
        ({"args": {"scale": 1.0}}, "takes the arguments of model.module"),
        ({"module": "user_models:LinearModel", "args": [1]}, "expected a mapping"),
    ],
)
def test_a_model_section_mixing_the_two_kinds_is_refused(small_run, model, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _config(small_run, "mixed", model)


@pytest.mark.parametrize(
    ("model", "tower_class"),
    [
        ({"bottom_mlp": [16, 8], "top_mlp": [16]}, towers.Dlrm),
        ({"tower": {"type": "dcn_v2", "cross_layers": 3, "mlp": [8]}}, towers.DcnV2),
    ],
)
def test_a_config_without_model_module_runs_its_shipped_tower_as_an_nnx_module(
    small_run, model, tower_class
):
    config = _config(small_run, "shipped", model)
    model = _dense_model.dense_model(config, _train.make_mesh(config.mesh.devices))
    tower = model.merged(model.init(jax.random.key(0)))
    assert type(tower) is tower_class
    # The parameters of the config's functional tower, array for array.
    want = _model.init_params(
        jax.random.key(0),
        config.model,
        config.layout.num_dense_features,
        embedding.feature_dims(config.feature_specs),
    )
    assert jax.tree.map(np.shape, tower.dense_params()) == jax.tree.map(np.shape, want)


@pytest.mark.parametrize(
    "model",
    [
        {"bottom_mlp": [16, 8], "top_mlp": [16]},
        {"tower": {"type": "dcn_v2", "cross_layers": 2, "mlp": [8]}},
    ],
)
def test_the_shipped_towers_first_step_is_the_functional_step(small_run, model):
    """The trainer's first step of `model.tower` against `_model.loss_fn`'s loss and
    gradients and the dense optimizer, unparallelized, from the same parameters on
    the activations of the run's own lookup."""
    _, _, _, data = small_run
    config = _config(small_run, "shipped-step", model)
    options = _train.TrainOptions(data=data, steps=1, progress=False, pipelined=False)
    run = _train._Run(config, options, _train.make_mesh(config.mesh.devices))
    params = jax.device_get(run.dense_model.merged(run.state.params).dense_params())
    batch, activations = _first_batch(config, data, run.tables)
    (loss, _), grads = jax.value_and_grad(_model.loss_fn, has_aux=True)(
        params,
        np.asarray(batch.dense),
        {name: a.astype(np.float32) for name, a in activations.items()},
        np.asarray(batch.labels),
    )
    optimizer = _model.dense_optimizer(config.model)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    want = optax.apply_updates(params, updates)

    result = _train.train(config, options)
    np.testing.assert_allclose(result.losses[0], loss, rtol=1e-5)
    got = run.dense_model.merged(result.train_state.params).dense_params()
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_pipeshard_with_a_model_of_ones_own_is_refused_naming_the_layer_marks(small_run):
    config = _config(small_run, "piped-user", {"pipeshard": {"stages": 2, "microbatches": 2}})
    mesh = _train.make_mesh(config.mesh.devices)
    with pytest.raises(UsageError, match="pipeline boundaries that sparseflow._model.forward"):
        _dense_model.dense_model(config, mesh, model_class=user_models.LinearModel)
    # The config's own tower takes it, and counts its layers: the bottom MLP's,
    # the top MLP's and the final one.
    tower = _dense_model.dense_model(config, mesh)
    layers = len(config.model.bottom_mlp) + len(config.model.top_mlp) + 1
    assert tower.merged(tower.init(jax.random.key(0))).num_layers() == layers


def test_a_user_models_run_resumes_exactly_from_its_checkpoint(small_run):
    tmp, _, _, data = small_run
    config = _config(small_run, "resumed", {"module": "user_models:LinearModel"})
    checkpoints = tmp / "user-model-checkpoints"
    assert_resume_is_exact(config, checkpoints, data=data, progress=False)


def test_the_shipped_towers_nnx_modules_train_as_user_models(small_run):
    _, _, _, data = small_run
    model = {"module": "sparseflow.towers:DcnV2", "args": {"cross_layers": 2, "mlp": [16]}}
    model["args"]["bottom_mlp"] = [16, 8]
    config = _config(small_run, "towers", model)
    result = _train.train(config, _train.TrainOptions(data=data, steps=3, progress=False))
    assert len(result.losses) == 3 and all(np.isfinite(result.losses))


def _squared_error(logits, labels):
    return jnp.mean((jax.nn.sigmoid(logits) - labels) ** 2)


def test_the_trainer_takes_a_model_class_and_a_loss(small_run):
    _, path, _, data = small_run
    trainer = sparseflow.Trainer(path, user_models.LinearModel, loss=_squared_error)
    options = _train.TrainOptions(
        data=data, steps=3, progress=False, model=user_models.LinearModel, loss=_squared_error
    )
    config = trainer._run_config()
    mesh = _train.make_mesh(config.mesh.devices)
    run = _train._Run(config, options, mesh)
    result = trainer.fit(data, steps=3, progress=False)
    assert len(result.losses) == 3 and config.model.module == "user_models:LinearModel"
    z, y = _first_batch_logits(config, data, run.state.params, run.tables)
    expected = np.mean((1 / (1 + np.exp(-z)) - y) ** 2)
    np.testing.assert_allclose(result.losses[0], expected, rtol=1e-5)


def test_outputs_other_than_logits_need_a_loss_that_takes_them(small_run):
    config = _config(small_run, "pairs", {"module": "user_models:PairLogits"})
    mesh = _train.make_mesh(config.mesh.devices)
    with pytest.raises(UsageError, match=re.escape("got float32[512, 512]; a model with other")):
        _dense_model.dense_model(config, mesh, loss=_model.sigmoid_cross_entropy)


def test_a_model_with_its_own_loss_trains_without_auc(small_run, caplog):
    _, _, _, data = small_run
    config = _config(small_run, "pairs", {"module": "user_models:PairLogits"})
    run = _train._Run(config, _train.TrainOptions(data=data), _train.make_mesh(config.mesh.devices))
    _, activations = _first_batch(config, data, run.tables)
    with caplog.at_level(logging.INFO, logger="sparseflow._train"):
        result = sparseflow.Trainer(config).fit(data, steps=4, eval_data=data, progress=False)
    assert "not per-example logits: no AUC" in caplog.text
    assert np.isnan(result.train_auc) and result.eval_auc is None
    # The first loss is the model's own on the run's first batch (float64 numpy):
    # every row's softmax cross-entropy against its diagonal.
    first, second = sorted(activations)[:2]
    project = run.state.params["project"]
    w = np.asarray(project["kernel"][...], np.float64)
    b = np.asarray(project["bias"][...], np.float64)
    logits = (activations[first] @ w + b) @ activations[second].T
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(result.losses[0], -np.mean(np.diagonal(log_softmax)), rtol=1e-5)


def test_the_trainer_refuses_devices_for_a_loaded_config(small_run):
    _, _, config, data = small_run
    with pytest.raises(UsageError, match="has its mesh already"):
        sparseflow.Trainer(config, devices=2).fit(data, steps=1)


def _brier(logits, labels):
    """The mean squared error of the predicted probability (a metric of the tests)."""
    return jnp.mean((jax.nn.sigmoid(logits) - labels) ** 2)


def _tensorboard_scalars(folder) -> dict[str, float]:
    """The last value of every scalar in the TensorBoard event files in `folder`."""
    import tensorflow as tf

    scalars = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                scalars[value.tag] = float(tf.make_ndarray(value.tensor))
    return scalars


def test_metrics_are_their_mean_over_the_evaluations_batches(small_run, tmp_path, monkeypatch):
    _, _, _, data = small_run
    config = _config(small_run, "metrics", {"module": "user_models:LinearModel"}, eval_batches=2)
    metrics = {"brier": _brier, "mean logit": lambda logits, labels: jnp.mean(logits)}
    # The metrics' program takes a mean over the devices: dispatched while the
    # forward (which has collectives too) ran, XLA:CPU could deadlock on the two.
    forward_done = []
    add = _eval_metrics.MetricMeans.add

    def add_after_the_forward(self, outputs, labels):
        forward_done.append(all(x.is_ready() for x in jax.tree.leaves(outputs)))
        add(self, outputs, labels)

    monkeypatch.setattr(_eval_metrics.MetricMeans, "add", add_after_the_forward)
    result = sparseflow.Trainer(config, metrics=metrics).fit(
        data, steps=3, eval_data=data, metrics_dir=tmp_path / "tb", progress=False
    )
    assert forward_done == [True, True]
    # Float64 numpy on the evaluation's two batches, under the trained model.
    values = {"brier": [], "mean logit": []}
    for index in range(2):
        z, y = _first_batch_logits(
            config,
            data,
            result.train_state.params,
            result.embedding_variables,
            index,
            training=False,
        )
        values["brier"].append(np.mean((1 / (1 + np.exp(-z)) - y) ** 2))
        values["mean logit"].append(np.mean(z))
    assert sorted(result.eval_metrics) == ["brier", "mean logit"]
    for name, per_batch in values.items():
        np.testing.assert_allclose(result.eval_metrics[name], np.mean(per_batch), rtol=1e-5)
    assert values["brier"][0] != values["brier"][1]  # a mean of two, not one batch
    assert 0.0 <= result.eval_auc <= 1.0  # the AUC is still reported beside them
    written = _tensorboard_scalars(tmp_path / "tb")
    for name in ("brier", "mean logit"):
        np.testing.assert_allclose(written[f"eval/{name}"], result.eval_metrics[name], rtol=1e-6)
    assert written["eval/auc"] == pytest.approx(result.eval_auc, rel=1e-6)


def test_a_model_without_per_example_logits_is_evaluated_by_its_metrics(small_run):
    _, _, _, data = small_run
    config = _config(
        small_run, "pairs-metric", {"module": "user_models:PairLogits"}, eval_batches=2
    )

    def diagonal_margin(logits, labels):
        """How far each row's own logit stands above the row's mean, on average."""
        return jnp.mean(jnp.diagonal(logits) - jnp.mean(logits, axis=1))

    result = sparseflow.Trainer(config, metrics={"margin": diagonal_margin}).fit(
        data, steps=2, eval_data=data, progress=False
    )
    assert result.eval_auc is None
    expected = []
    for index in range(2):
        _, activations = _first_batch(
            config, data, result.embedding_variables, index, training=False
        )
        first, second = sorted(activations)[:2]
        project = result.train_state.params["project"]
        w = np.asarray(project["kernel"][...], np.float64)
        b = np.asarray(project["bias"][...], np.float64)
        logits = (activations[first] @ w + b) @ activations[second].T
        expected.append(np.mean(np.diagonal(logits) - logits.mean(axis=1)))
    assert list(result.eval_metrics) == ["margin"]
    np.testing.assert_allclose(
        result.eval_metrics["margin"], np.mean(expected), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ({"auc": _brier}, "a metric's name is a non-empty string other than 'auc'"),
        ({"": _brier}, "a metric's name is a non-empty string"),
        ({"brier": 0.5}, "metric 'brier' is float, not a function"),
        (
            {"per example": lambda logits, labels: logits},
            "metric 'per example' must return a float scalar, got float32[512]",
        ),
        (
            {"broken": lambda logits, labels: logits @ labels[:3]},
            "metric 'broken' failed on outputs float32[512] and labels int32[512]",
        ),
        ([_brier], "metrics must map names to functions"),
    ],
)
def test_a_metric_that_cannot_score_the_outputs_is_refused_before_training(
    small_run, metrics, message
):
    _, _, config, data = small_run
    options = _train.TrainOptions(data=data, steps=1, progress=False, metrics=metrics)
    with pytest.raises(UsageError, match=re.escape(message)):
        _train._Run(config, options, _train.make_mesh(config.mesh.devices))
