"""The dense tower of the recommender, as pure functions: DLRM or DCN-v2.

DLRM (the default):

    dense features --bottom MLP--> x0 [B, d]
    activation of feature f [B, dim_f] --linear--> x_f [B, d]
        (or x_f = the activation itself, with `feature_projection: false`)
    z = upper triangle of [x0, x_1..x_F] [x0, x_1..x_F]^T   (pairwise dots)
    logit = top MLP([x0, z])

DCN-v2 (`model.tower: {type: dcn_v2, cross_layers: K, mlp: [...]}`):

    x0 = [bottom MLP(dense features), activations of every feature]  [B, D]
    x_{l+1} = x0 * (x_l W_l + b_l) + x_l,   l = 0..K-1   (full-rank cross)
    logit = MLP(x_K)

Embedding activations come from the sharded lookup; this module never sees
tables. Parameters are a plain dict pytree; `sparseflow.towers` holds them
as `nnx.Param`s and runs this forward (the modules the trainer runs).
The forward marks a pipeline boundary after every layer (a no-op outside
`parallel.pipeshard`), the layers that `model.pipeshard` with `layers:
manual` groups into stages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import embedding
from parallel import pipeshard
from sparseflow._tower_config import DcnV2Tower, PipeshardConfig

Params = dict
"""`{"bottom": [layer...], "project": {feature: w}, "top": [layer...]}` ("project"
only with `feature_projection`; DCN-v2: "cross" in its place)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes and the dense optimizer of the recommender.

    Attributes:
      bottom_mlp: hidden widths of the bottom MLP; the last is the
        interaction dim d.
      top_mlp: hidden widths of the top MLP (a final width-1 layer is added).
      learning_rate: of the dense part's Adam.
      tower: "dlrm" (bottom MLP, pairwise interactions, top MLP) or a
        `DcnV2Tower` (the bottom MLP, then cross layers and its MLP).
      pipeshard: run the tower as a pipeshard pipeline, or None.
      feature_projection: DLRM projects every feature's activation to the
        interaction dim d with a matrix of its own; False interacts the
        activations as they are (DLRM's original form, TorchRec's), which
        needs every embedding dim to be d.
      module: `"package.module:Class"`, a user's Flax NNX model to train in
        place of the shipped towers (`sparseflow._nnx_model`); None: `tower`.
      args: keyword arguments of `module`'s class.
    """

    bottom_mlp: tuple[int, ...] = (64, 16)
    top_mlp: tuple[int, ...] = (64, 32)
    learning_rate: float = 1e-3
    tower: str | DcnV2Tower = "dlrm"
    pipeshard: PipeshardConfig | None = None
    feature_projection: bool = True
    module: str | None = None
    args: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name in ("bottom_mlp", "top_mlp"):
            widths = tuple(getattr(self, name))
            if not widths or any(not isinstance(w, int) or w <= 0 for w in widths):
                raise ValueError(f"ModelConfig.{name} must be positive ints, got {widths!r}.")
            object.__setattr__(self, name, widths)
        if not self.learning_rate > 0:
            raise ValueError(f"ModelConfig.learning_rate must be > 0, got {self.learning_rate!r}.")

    @property
    def interaction_dim(self) -> int:
        return self.bottom_mlp[-1]


def _dense_layer(key: jax.Array, fan_in: int, fan_out: int) -> dict:
    scale = np.sqrt(2.0 / (fan_in + fan_out))
    return {
        "w": scale * jax.random.normal(key, (fan_in, fan_out), jnp.float32),
        "b": jnp.zeros((fan_out,), jnp.float32),
    }


def _mlp(key: jax.Array, widths: Sequence[int]) -> list[dict]:
    keys = jax.random.split(key, len(widths) - 1)
    return [_dense_layer(k, a, b) for k, a, b in zip(keys, widths[:-1], widths[1:], strict=True)]


def init_params(
    key: jax.Array, config: ModelConfig, num_dense_features: int, feature_dims: Mapping[str, int]
) -> Params:
    """Initial dense parameters.

    Args:
      key: PRNG key.
      config: model sizes.
      num_dense_features: width of the dense input.
      feature_dims: embedding dim of every sparse feature, by name.
    """
    if isinstance(config.tower, DcnV2Tower):
        return _init_dcn_v2(key, config, num_dense_features, feature_dims)
    d = config.interaction_dim
    num_pairs = (len(feature_dims) + 1) * len(feature_dims) // 2
    k_bottom, k_top, k_project = jax.random.split(key, 3)
    params = {
        "bottom": _mlp(k_bottom, (num_dense_features, *config.bottom_mlp)),
        "top": _mlp(k_top, (d + num_pairs, *config.top_mlp, 1)),
    }
    if not config.feature_projection:
        check_feature_dims(config, feature_dims)
        return params
    project_keys = jax.random.split(k_project, max(len(feature_dims), 1))
    params["project"] = {
        name: _dense_layer(k, dim, d)["w"]
        for k, (name, dim) in zip(project_keys, sorted(feature_dims.items()), strict=False)
    }
    return params


def check_feature_dims(config: ModelConfig, feature_dims: Mapping[str, int]) -> None:
    """Checks that DLRM without feature projections can interact the activations.

    Raises:
      ValueError: `feature_projection` is off and some embedding dim is not
        the interaction dim.
    """
    if config.feature_projection or isinstance(config.tower, DcnV2Tower):
        return
    d = config.interaction_dim
    wrong = {name: dim for name, dim in sorted(feature_dims.items()) if dim != d}
    if wrong:
        raise ValueError(
            "feature_projection: false interacts the activations as they are, so every "
            f"embedding dim must be the bottom MLP's last width {d}; the features {wrong} "
            "(name: dim) are not. Project them (feature_projection: true) or change the widths."
        )


def _init_dcn_v2(key, config: ModelConfig, num_dense_features: int, feature_dims) -> Params:
    width = config.bottom_mlp[-1] + sum(feature_dims.values())
    k_bottom, k_cross, k_mlp = jax.random.split(key, 3)
    cross_keys = jax.random.split(k_cross, config.tower.cross_layers)
    return {
        "bottom": _mlp(k_bottom, (num_dense_features, *config.bottom_mlp)),
        "cross": [_dense_layer(k, width, width) for k in cross_keys],
        "top": _mlp(k_mlp, (width, *config.tower.mlp, 1)),
    }


def num_layers(params: Params) -> int:
    """Layers between the forward's pipeline boundaries."""
    return len(params["bottom"]) + len(params.get("cross", ())) + len(params["top"])


def _apply_mlp(
    layers: list[dict], x: jax.Array, *, final_activation: bool, mark_last: bool = True
) -> jax.Array:
    """The MLP, a pipeline boundary after each layer (but the last unless `mark_last`)."""
    for i, layer in enumerate(layers):
        x = x @ layer["w"] + layer["b"]
        if final_activation or i < len(layers) - 1:
            x = jax.nn.relu(x)
        if mark_last or i < len(layers) - 1:
            pipeshard.mark_pipeline_boundary()
    return x


def forward(params: Params, dense: jax.Array, activations: Mapping[str, jax.Array]) -> jax.Array:
    """Logits of a batch.

    Args:
      params: from `init_params`.
      dense: `float32[batch, num_dense_features]`.
      activations: `float32[batch, dim_f]` per feature (the lookup's output).

    Returns:
      `float32[batch]` logits.
    """
    x0 = _apply_mlp(params["bottom"], dense, final_activation=True)
    if "cross" in params:
        return _dcn_v2(params, x0, activations)
    if "project" in params:
        projected = [activations[name] @ w for name, w in sorted(params["project"].items())]
    else:
        projected = [activations[name] for name in sorted(activations)]
    top_input = jnp.concatenate([x0, embedding.pairwise_dots([x0, *projected])], axis=1)
    return _apply_mlp(params["top"], top_input, final_activation=False, mark_last=False)[:, 0]


def _dcn_v2(params: Params, bottom: jax.Array, activations: Mapping[str, jax.Array]) -> jax.Array:
    x0 = jnp.concatenate([bottom] + [activations[name] for name in sorted(activations)], axis=1)
    x = x0
    for layer in params["cross"]:
        x = x0 * (x @ layer["w"] + layer["b"]) + x
        pipeshard.mark_pipeline_boundary()
    return _apply_mlp(params["top"], x, final_activation=False, mark_last=False)[:, 0]


def loss_fn(
    params: Params, dense: jax.Array, activations: Mapping[str, jax.Array], labels: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """`(mean sigmoid cross-entropy, logits)` of a batch; `labels: int32[batch]`."""
    logits = forward(params, dense, activations)
    return sigmoid_cross_entropy(logits, labels), logits


def sigmoid_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """`float32[]`: the mean sigmoid cross-entropy of `logits: float32[batch]`
    against `labels: int32[batch]` in {0, 1}."""
    return optax.sigmoid_binary_cross_entropy(logits, labels.astype(jnp.float32)).mean()


def dense_optimizer(config: ModelConfig) -> optax.GradientTransformation:
    """The optimizer of the dense parameters.

    Adam on the parameters flattened into one vector: the same elementwise
    update, with a state of three arrays instead of two per parameter. Every
    array a step returns costs a buffer per device on each call.
    """
    return optax.flatten(optax.adam(config.learning_rate))


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve by the rank-sum formula (ties get mid-ranks).

    Args:
      labels: `int[n]` in {0, 1}.
      scores: `float[n]`.

    Returns:
      The AUC, or NaN when only one class is present.
    """
    labels = np.asarray(labels).astype(bool)
    scores = np.asarray(scores)
    positives = int(labels.sum())
    negatives = labels.size - positives
    if not positives or not negatives:
        return float("nan")
    # Ties share their mid-rank, so their order does not matter: an unstable
    # sort of the scores as given (float32 logits), an eighth of the time of a
    # stable one of them widened to float64 (docs/benchmarks.md).
    order = np.argsort(scores)
    sorted_scores = scores[order]
    ranks = np.empty(scores.size, np.float64)
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    mid = (starts + ends + 1) / 2.0  # 1-based mid-rank of each tie group
    ranks[order] = np.repeat(mid, ends - starts)
    return float((ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives))
