"""`Dlrm`: the shipped DLRM tower as an NNX module."""

from __future__ import annotations

from collections.abc import Sequence

from flax import nnx

from embedding.nnx import Embed
from sparseflow import _model
from sparseflow.towers._tower import Tower


class Dlrm(Tower):
    """DLRM over an `Embed` layer: the bottom MLP on the dense features, each
    feature's activation projected to the interaction dim (or as it is), the
    pairwise dot products, the top MLP (`sparseflow._model`'s docstring draws
    it; `model.tower: dlrm` in a run config).

    `params` hold `bottom` and `top` (lists of `{"w", "b"}`) and, with
    feature projection, `project` (`float32[embedding_dim, d]` by feature).
    """

    def __init__(
        self,
        embed: Embed,
        num_dense_features: int,
        *,
        bottom_mlp: Sequence[int],
        top_mlp: Sequence[int],
        feature_projection: bool = True,
        rngs: nnx.Rngs,
    ):
        """Creates the tower's parameters for `embed`'s features.

        Args:
          embed: an `Embed` layer over a dict of feature specs by feature name.
          num_dense_features: the width of the dense input.
          bottom_mlp: hidden widths of the bottom MLP; the last is the
            interaction dim d.
          top_mlp: hidden widths of the top MLP (a final width-1 layer is added).
          feature_projection: project every feature's activation to d; False
            interacts the activations as they are (every embedding dim d).
          rngs: the initializers get `rngs.params()`.

        Raises:
          TypeError: `embed` is not an `Embed` layer over a dict of feature specs.
          ValueError: widths that are not positive ints; without feature
            projection, an embedding dim that is not d.
        """
        config = _model.ModelConfig(
            bottom_mlp=bottom_mlp,
            top_mlp=top_mlp,
            feature_projection=feature_projection,
        )
        super().__init__(embed, config, num_dense_features, rngs)
