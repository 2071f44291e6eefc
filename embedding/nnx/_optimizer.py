"""`PartitionedOptimizer`: embedding variables take their updated values, optax the rest."""

from __future__ import annotations

from typing import Any

import optax
from flax import nnx

from embedding.nnx._layer import Embed, embed_mesh
from embedding.nnx._variables import EmbeddingParam


def _paths(state: Any) -> set:
    return {path for path, _ in nnx.to_flat_state(state)}


class PartitionedOptimizer(nnx.Optimizer):
    """An `nnx.Optimizer` for models holding `Embed` layers.

    The gradient `nnx.grad` gives for an `EmbeddingParam` is already the
    variable after its sparse optimizer step (see `Embed`), so `update`
    replaces every `EmbeddingParam` by it and advances every layer's
    `EmbeddingStep`; `tx` updates the other variables `wrt` selects, as
    `nnx.Optimizer` does. `opt_state` holds no state for the tables.

    The gradients must come from a loss that calls every `Embed` layer of
    the model exactly once: JAX adds up the "gradients" of two calls (two
    updated tables), and gives zeros for a layer the loss never calls, which
    `update` would write as its tables.

    Attributes:
      mesh: the mesh of the model's `Embed` layers (for `state_shardings`).
    """

    def __init__(
        self,
        model: nnx.Module,
        tx: optax.GradientTransformation,
        *,
        wrt: nnx.filterlib.Filter = nnx.Param,
    ):
        """Creates the optimizer of `model`'s dense variables.

        Args:
          model: a module holding `Embed` layers, all on one mesh.
          tx: the optax transformation of the other variables.
          wrt: the variables `tx` updates; `EmbeddingParam`s are left out.

        Raises:
          ValueError: `model` holds no `Embed` layer, or layers on several meshes.
        """
        mesh = embed_mesh(model)
        super().__init__(model, tx, wrt=nnx.All(wrt, nnx.Not(EmbeddingParam)))
        self.mesh = mesh

    def update(self, model: nnx.Module, grads: Any, /, **kwargs: Any) -> optax.Updates:
        """Applies one training step's gradients to `model`.

        Args:
          model: the module the optimizer was made for.
          grads: `nnx.grad`'s gradients of a loss in which every `Embed` layer
            of `model` was called once (differentiated with respect to
            `nnx.Param`, or a filter that keeps `EmbeddingParam`).
          **kwargs: passed to `tx.update`, as `nnx.Optimizer.update` does.

        Returns:
          `tx`'s updates of the dense variables.

        Raises:
          ValueError: `grads` lacks an `EmbeddingParam` of `model`.
        """
        updated = nnx.state(grads, EmbeddingParam)
        missing = _paths(nnx.state(model, EmbeddingParam)) - _paths(updated)
        if missing:
            names = sorted("/".join(map(str, path)) for path in missing)
            raise ValueError(
                f"grads hold no updated value for the embedding variables {names}: take "
                "the gradient with respect to nnx.Param (EmbeddingParam is one) or a filter "
                "that keeps EmbeddingParam."
            )
        nnx.update(model, updated)
        for _, layer in nnx.iter_graph(model):
            if isinstance(layer, Embed):
                layer.step[...] += 1
        return super().update(model, grads, **kwargs)
