"""Running a model whose `Embed` layers return given activations instead of looking up.

A trainer that splits a model into a sparse stage (the lookup and the table
update, on the tables) and a dense stage (the rest of the model) computes
the activations in the first and runs the model in the second with them in
place of the layers' lookups:

    def dense_loss(model, activations, dense, labels):
        layer = embed_layers(model)["embed"]
        with provided_activations({layer: activations}):
            return loss(model(None, dense), labels)

    dense_params = nnx.All(nnx.Param, nnx.Not(EmbeddingParam))
    grad_fn = nnx.value_and_grad(dense_loss, argnums=(nnx.DiffState(0, dense_params), 1))
    loss, (param_grads, activation_grads) = grad_fn(model, activations, dense, labels)

`activation_grads` then go to `embedding.apply_gradients` in the sparse stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from embedding.nnx._context import giving
from embedding.nnx._layer import Embed


@contextlib.contextmanager
def provided_activations(activations_by_layer: Mapping[Embed, Any]) -> Iterator[None]:
    """Makes each given `Embed` layer return its activations instead of looking up.

    Inside the block, calling a given layer returns its activations as they
    are (see `Embed.__call__`): differentiating a loss with respect to them
    gives their gradients, the tables are not read (differentiate with
    respect to `nnx.All(nnx.Param, nnx.Not(EmbeddingParam))`, or the tables
    get zero gradients that `PartitionedOptimizer` would write back) and the
    layer's step is left alone. Layers not given look up as usual.

    A layer is matched through NNX transforms and `nnx.split`/`nnx.merge`:
    the layer of a model and the layer of its merged copy are one layer.
    Enter the block inside the function that `jax.jit` or `nnx.jit` traces,
    with that function's activations: jit's cache does not see the context,
    so a trace made inside a block entered outside would keep its
    activations as constants for later calls. Blocks nest: an inner block
    gives its layers new activations and leaves the outer block's others in
    force; on leaving a block, by an exception too, the enclosing context
    is back.

    Args:
      activations_by_layer: per `Embed` layer (see `embed_layers`), the pytree
        of its `feature_specs` with, per feature, `float[rows, embedding_dim]`
        (what the layer's call would return; the same `rows` for every
        feature, e.g. a microbatch of the global batch).

    Raises:
      TypeError: a key is not an `Embed` layer.
      ValueError: activations lack a feature of the layer's specs, have
        one the specs do not define, or have another shape.
    """
    for layer, activations in activations_by_layer.items():
        _check_activations(layer, activations)
    with giving(
        (layer._config, activations) for layer, activations in activations_by_layer.items()
    ):
        yield


def _check_activations(layer: Any, activations: Any) -> None:
    if not isinstance(layer, Embed):
        raise TypeError(
            "provided_activations takes activations by embedding.nnx.Embed layer, got a key "
            f"of type {type(layer).__name__}; find a model's layers with embed_layers(model)."
        )
    specs = _by_feature(layer.feature_specs)
    given = _by_feature(activations)
    missing, unknown = sorted(specs.keys() - given.keys()), sorted(given.keys() - specs.keys())
    if missing or unknown:
        raise ValueError(
            f"The activations given to the Embed layer of features {sorted(specs)} miss "
            f"{missing} and hold {unknown} beyond them; give one float[rows, embedding_dim] "
            "array per feature, in the structure of layer.feature_specs."
        )
    shapes = {name: tuple(np.shape(value)) for name, value in given.items()}
    for name, spec in specs.items():
        dim = spec.output_shape[1]
        if len(shapes[name]) != 2 or shapes[name][1] != dim:
            raise ValueError(
                f"The activations given for feature {name!r} have shape {list(shapes[name])}; "
                f"the Embed layer returns float[rows, {dim}] for it."
            )
    rows = {name: shape[0] for name, shape in sorted(shapes.items())}
    if len(set(rows.values())) > 1:
        raise ValueError(
            f"The activations given to the Embed layer have rows {rows} by feature; the "
            "layer returns the same rows for every feature."
        )


def _by_feature(tree: Any) -> dict[str, Any]:
    """The leaves of `tree` by their path (`"a1"` in a dict of features)."""
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }
