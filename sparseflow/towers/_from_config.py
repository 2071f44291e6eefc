"""The NNX tower of a run config's `model` section."""

from __future__ import annotations

from flax import nnx

from embedding.nnx import Embed
from sparseflow import _model
from sparseflow._tower_config import DcnV2Tower
from sparseflow.towers._dcn_v2 import DcnV2
from sparseflow.towers._dlrm import Dlrm


def from_config(
    embed: Embed, config: _model.ModelConfig, num_dense_features: int, *, rngs: nnx.Rngs
) -> Dlrm | DcnV2:
    """The tower `config.tower` names, of `config`'s widths, over `embed`'s features.

    Its `dense_params()` have the structure and shapes of the `params` that
    `sparseflow train` keeps for a run of this config, so
    `load_dense_params` takes a checkpoint's.

    Args:
      embed: an `Embed` layer over a dict of feature specs by feature name.
      config: a run config's `model` (`RunConfig.model`).
      num_dense_features: the width of the dense input.
      rngs: the initializers get `rngs.params()`.
    """
    if isinstance(config.tower, DcnV2Tower):
        return DcnV2(
            embed,
            num_dense_features,
            bottom_mlp=config.bottom_mlp,
            cross_layers=config.tower.cross_layers,
            mlp=config.tower.mlp,
            rngs=rngs,
        )
    return Dlrm(
        embed,
        num_dense_features,
        bottom_mlp=config.bottom_mlp,
        top_mlp=config.top_mlp,
        feature_projection=config.feature_projection,
        rngs=rngs,
    )
