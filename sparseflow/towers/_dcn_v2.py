"""`DcnV2`: the shipped DCN-v2 tower as an NNX module."""

from __future__ import annotations

from collections.abc import Sequence

from flax import nnx

from embedding.nnx import Embed
from sparseflow import _model
from sparseflow._tower_config import DcnV2Tower
from sparseflow.towers._tower import Tower


class DcnV2(Tower):
    """DCN-v2 over an `Embed` layer: `x0` = [bottom MLP of the dense features,
    every feature's activation], full-rank cross layers `x0 * (x W + b) + x`,
    then an MLP (`sparseflow._model`'s docstring draws it; `model.tower:
    {type: dcn_v2}` in a run config).

    `params` hold `bottom`, `cross` and `top`, lists of `{"w", "b"}`.
    """

    def __init__(
        self,
        embed: Embed,
        num_dense_features: int,
        *,
        bottom_mlp: Sequence[int],
        cross_layers: int,
        mlp: Sequence[int],
        rngs: nnx.Rngs,
    ):
        """Creates the tower's parameters for `embed`'s features.

        Args:
          embed: an `Embed` layer over a dict of feature specs by feature name.
          num_dense_features: the width of the dense input.
          bottom_mlp: hidden widths of the bottom MLP.
          cross_layers: K, the cross layers.
          mlp: hidden widths after the cross layers (a final width-1 layer is added).
          rngs: the initializers get `rngs.params()`.

        Raises:
          TypeError: `embed` is not an `Embed` layer over a dict of feature specs.
          ValueError: widths or `cross_layers` that are not positive ints.
        """
        config = _model.ModelConfig(
            bottom_mlp=bottom_mlp,
            tower=DcnV2Tower(cross_layers=cross_layers, mlp=mlp),
        )
        super().__init__(embed, config, num_dense_features, rngs)
