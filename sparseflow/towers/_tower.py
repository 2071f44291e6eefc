"""What the NNX towers share: an `Embed` layer, and the dense parameters of
`sparseflow._model` held as `nnx.Param`s and run by its `forward`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

import embedding
from embedding.nnx import Embed
from sparseflow import _model


class Tower(nnx.Module):
    """A dense tower of `sparseflow._model` over the activations of an `Embed` layer.

    The math is `sparseflow._model.forward`'s, run on the parameters this
    module holds, with its pipeline boundaries after every layer (which
    `model.pipeshard` groups into stages); `sparseflow train` runs this
    module for `model.tower`.

    Attributes:
      embed: the `Embed` layer; its feature specs are a dict by feature name.
      params: the dense parameters as `nnx.Param`s, in the pytree of
        `sparseflow._model.init_params` (e.g. `params["bottom"][i]["w"]`,
        `float32[fan_in, fan_out]`; see `dense_params`).
      mean_over_examples: True: each example's logit depends on that example
        alone, so with the mean sigmoid cross-entropy the trainer may compute
        the dense step per device (`sparseflow.Trainer`'s models may say so too).
    """

    mean_over_examples = True

    def __init__(
        self, embed: Embed, config: _model.ModelConfig, num_dense_features: int, rngs: nnx.Rngs
    ):
        """Creates the parameters of `config`'s tower for `embed`'s features.

        Args:
          embed: an `Embed` layer over a dict of feature specs by feature name.
          config: the tower's sizes (`tower`, the MLP widths, `feature_projection`).
          num_dense_features: the width of the dense input.
          rngs: `sparseflow._model.init_params` gets `rngs.params()` as its key.

        Raises:
          TypeError: `embed` is not an `Embed` layer over a dict of feature specs.
          ValueError: DLRM without feature projection, and an embedding dim
            that is not the interaction dim.
        """
        feature_dims = _feature_dims(embed)
        self.embed = embed
        params = _model.init_params(rngs.params(), config, num_dense_features, feature_dims)
        self.params = nnx.data(jax.tree.map(nnx.Param, params))

    def __call__(self, sparse_batch: embedding.PreprocessedInput | None, dense: jax.Array):
        """Logits of a batch.

        Args:
          sparse_batch: the batch's sparse features as `embed` takes them
            (None under `embedding.nnx.provided_activations`).
          dense: `float32[batch, num_dense_features]`.

        Returns:
          `float32[batch]` logits.
        """
        return _model.forward(self.dense_params(), dense, self.embed(sparse_batch))

    def num_layers(self) -> int:
        """The layers between the forward's pipeline boundaries."""
        return _model.num_layers(self.dense_params())

    def dense_params(self) -> _model.Params:
        """The dense parameters' values as the plain dict of `sparseflow._model.init_params`,
        which `sparseflow._model.forward` takes."""
        return jax.tree.map(lambda param: param[...], self.params, is_leaf=_is_param)

    def load_dense_params(self, params: _model.Params) -> None:
        """Sets the dense parameters from the plain dict of `sparseflow._model.init_params`.

        Raises:
          ValueError: `params` are of another tower, other features or other
            sizes (another structure, or an array of another shape).
        """
        held = self.dense_params()
        if jax.tree.structure(params) != jax.tree.structure(held):
            raise ValueError(
                f"The params are a {jax.tree.structure(params)}; this {type(self).__name__} "
                f"holds a {jax.tree.structure(held)} (another tower, other features or other "
                "depths)."
            )
        for (path, value), want in zip(
            jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(held), strict=True
        ):
            if np.shape(value) != want.shape:
                raise ValueError(
                    f"params{jax.tree_util.keystr(path)} has shape {list(np.shape(value))}; "
                    f"this {type(self).__name__} holds {list(want.shape)} there."
                )
        jax.tree.map(_set, self.params, params, is_leaf=_is_param)


def _feature_dims(embed: Any) -> dict[str, int]:
    """The embedding dim of every feature of `embed`, by feature name."""
    specs = embed.feature_specs if isinstance(embed, Embed) else None
    if not isinstance(specs, Mapping) or not all(
        isinstance(spec, embedding.FeatureSpec) for spec in specs.values()
    ):
        raise TypeError(
            "A tower takes an embedding.nnx.Embed layer over a dict of FeatureSpecs by "
            f"feature name, got {type(embed).__name__}"
            + ("" if specs is None else f" over a {type(specs).__name__}")
            + "."
        )
    return embedding.feature_dims(specs)


def _is_param(node: Any) -> bool:
    return isinstance(node, nnx.Param)


def _set(param: nnx.Param, value: Any) -> None:
    param[...] = value
