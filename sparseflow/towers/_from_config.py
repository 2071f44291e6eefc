"""The NNX tower of a run config's `model` section."""

from __future__ import annotations

from typing import Any

from flax import nnx

from embedding.nnx import Embed
from sparseflow import _model
from sparseflow._tower_config import DcnV2Tower
from sparseflow.towers._dcn_v2 import DcnV2
from sparseflow.towers._dlrm import Dlrm


def tower_class_and_args(config: _model.ModelConfig) -> tuple[type[Dlrm | DcnV2], dict[str, Any]]:
    """The tower class `config.tower` names and its keyword arguments of `config`'s widths
    (all but the layer, the dense width and `rngs`), as `from_config` and the trainer
    build it."""
    if isinstance(config.tower, DcnV2Tower):
        return DcnV2, {
            "bottom_mlp": config.bottom_mlp,
            "cross_layers": config.tower.cross_layers,
            "mlp": config.tower.mlp,
        }
    return Dlrm, {
        "bottom_mlp": config.bottom_mlp,
        "top_mlp": config.top_mlp,
        "feature_projection": config.feature_projection,
    }


def from_config(
    embed: Embed, config: _model.ModelConfig, num_dense_features: int, *, rngs: nnx.Rngs
) -> Dlrm | DcnV2:
    """The tower `config.tower` names, of `config`'s widths, over `embed`'s features.

    It is the model `sparseflow train` runs for this config: its `nnx.Param`s
    are the `params` of the trainer's `TrainState` and checkpoints, and its
    `dense_params()` the plain dict of `sparseflow._model.init_params`, which
    `load_dense_params` takes.

    Args:
      embed: an `Embed` layer over a dict of feature specs by feature name.
      config: a run config's `model` (`RunConfig.model`).
      num_dense_features: the width of the dense input.
      rngs: the initializers get `rngs.params()`.
    """
    tower_class, args = tower_class_and_args(config)
    return tower_class(embed, num_dense_features, rngs=rngs, **args)
