"""The DLRM dense tower against a float64 numpy reference, and the AUC."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import optax
import pytest

from sparseflow import _model


def _reference_forward(params, dense, activations):
    def mlp(layers, x, final_activation):
        for i, layer in enumerate(layers):
            x = x @ np.asarray(layer["w"], np.float64) + np.asarray(layer["b"], np.float64)
            if final_activation or i < len(layers) - 1:
                x = np.maximum(x, 0.0)
        return x

    x0 = mlp(params["bottom"], dense.astype(np.float64), True)
    if "project" in params:
        vectors = [x0] + [
            activations[name].astype(np.float64) @ np.asarray(params["project"][name], np.float64)
            for name in sorted(params["project"])
        ]
    else:
        vectors = [x0] + [activations[name].astype(np.float64) for name in sorted(activations)]
    batch = dense.shape[0]
    pairs = []
    for b in range(batch):
        row = []
        for i, j in itertools.combinations(range(len(vectors)), 2):
            row.append(float(vectors[i][b] @ vectors[j][b]))
        pairs.append(row)
    top_input = np.concatenate([x0, np.asarray(pairs)], axis=1)
    return mlp(params["top"], top_input, False)[:, 0]


@pytest.mark.parametrize(
    "projection, dims",
    [(True, {"a": 8, "b": 16, "c": 4}), (False, {"b": 4, "a": 4, "c": 4})],
    ids=["projected", "as they are"],
)
def test_forward_matches_reference(projection, dims):
    config = _model.ModelConfig(bottom_mlp=(8, 4), top_mlp=(6,), feature_projection=projection)
    params = _model.init_params(jax.random.key(0), config, 5, dims)
    assert ("project" in params) == projection
    rng = np.random.default_rng(0)
    dense = rng.normal(size=(7, 5)).astype(np.float32)
    activations = {k: rng.normal(size=(7, d)).astype(np.float32) for k, d in dims.items()}
    got = np.asarray(_model.forward(params, dense, activations))
    np.testing.assert_allclose(
        got, _reference_forward(params, dense, activations), rtol=1e-4, atol=1e-5
    )


def test_without_feature_projection_every_dim_must_be_the_interaction_dim():
    config = _model.ModelConfig(bottom_mlp=(8, 4), feature_projection=False)
    with pytest.raises(ValueError, match=r"width 4; the features \{'b': 8\}"):
        _model.init_params(jax.random.key(0), config, 5, {"a": 4, "b": 8})


def test_training_reduces_loss():
    config = _model.ModelConfig(bottom_mlp=(16, 8), top_mlp=(16,), learning_rate=1e-2)
    dims = {"a": 8}
    rng = np.random.default_rng(1)
    dense = rng.normal(size=(256, 4)).astype(np.float32)
    activations = {"a": rng.normal(size=(256, 8)).astype(np.float32)}
    labels = (dense[:, 0] + activations["a"][:, 0] > 0).astype(np.int32)
    params = _model.init_params(jax.random.key(1), config, 4, dims)
    optimizer = _model.dense_optimizer(config)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state):
        (loss, _), grads = jax.value_and_grad(_model.loss_fn, has_aux=True)(
            params, dense, activations, labels
        )
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for _ in range(200):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    _, logits = _model.loss_fn(params, dense, activations, labels)
    assert losses[-1] < 0.5 * losses[0]
    assert _model.roc_auc(labels, np.asarray(logits)) > 0.95


def _pairwise_auc(labels, scores):
    pos = scores[labels == 1][:, None].astype(np.float64)
    neg = scores[labels == 0][None, :].astype(np.float64)
    wins = (pos > neg).sum() + 0.5 * (pos == neg).sum()
    return wins / (pos.size * neg.size)


@pytest.mark.parametrize("size", [60, 3000])  # the larger sorts ties out of order
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("seed", range(3))
def test_roc_auc_equals_pairwise_count(seed, dtype, size):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, size)
    scores = rng.integers(0, 8, size).astype(dtype)  # many ties
    assert _model.roc_auc(labels, scores) == pytest.approx(_pairwise_auc(labels, scores))


def test_roc_auc_one_class_is_nan():
    assert np.isnan(_model.roc_auc(np.ones(5), np.arange(5.0)))


def test_model_config_errors():
    with pytest.raises(ValueError, match="bottom_mlp"):
        _model.ModelConfig(bottom_mlp=())
    with pytest.raises(ValueError, match="learning_rate"):
        _model.ModelConfig(learning_rate=0.0)
