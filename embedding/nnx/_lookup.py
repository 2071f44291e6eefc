"""The lookup as a `jax.custom_vjp` whose backward is the sparse optimizer step.

The forward is `embedding.sparse_dense_matmul`. The backward does not compute
a gradient of the tables: it runs `embedding.apply_gradients` (the tables'
own optimizers, on the rows the batch touched) and returns the updated tables
and slots as the cotangent of the variables. `PartitionedOptimizer` writes
that cotangent back in place of an optax step, so no table-sized gradient is
ever formed. The step and the layout get no cotangent.

Because the cotangent is a new value, not a gradient, JAX's rule for a value
used twice (sum the cotangents) does not fit it: a layer is looked up once
per loss.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh

import embedding
from embedding._routing import LookupPath, select_path


@dataclasses.dataclass(frozen=True)
class LookupConfig:
    """The static part of a layer's lookup (hashable, for jit's static arguments).

    Attributes:
      leaves: the prepared `FeatureSpec`s, in `jax.tree.leaves` order.
      treedef: the structure of the feature specs.
      mesh: the 1-D mesh the tables are sharded over.
      num_sc_per_device: S, partitions per device.
      enable_minibatching: as passed to the preprocessing.
    """

    leaves: tuple[embedding.FeatureSpec, ...]
    treedef: Any
    mesh: Mesh
    num_sc_per_device: int
    enable_minibatching: bool

    @property
    def feature_specs(self) -> Any:
        """The prepared feature specs, in the structure the layer was given."""
        return self.treedef.unflatten(self.leaves)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def lookup(
    config: LookupConfig,
    variables: Mapping[str, embedding.EmbeddingVariables],
    step: jax.Array,
    preprocessed_input: embedding.PreprocessedInput,
) -> Any:
    """The activations of one batch; differentiating gives updated variables.

    Args:
      config: the layer's static configuration.
      variables: `EmbeddingVariables` by stack name.
      step: `int32[]`, the sparse updates applied so far.
      preprocessed_input: the batch's layout as global arrays over the mesh.

    Returns:
      The pytree of the feature specs with, per feature,
      `float32[global_batch, embedding_dim]`. Its VJP maps activation
      gradients to the variables after one optimizer step (not to a gradient).
    """
    del step
    return embedding.sparse_dense_matmul(
        preprocessed_input,
        variables,
        config.feature_specs,
        config.mesh,
        enable_minibatching=config.enable_minibatching,
    )


def _lookup_fwd(config, variables, step, preprocessed_input):
    activations, index = embedding.sparse_dense_matmul(
        preprocessed_input,
        variables,
        config.feature_specs,
        config.mesh,
        enable_minibatching=config.enable_minibatching,
        return_layout_index=True,
    )
    return activations, (variables, step, preprocessed_input, index)


def _lookup_bwd(config, residuals, activation_grads):
    variables, step, preprocessed_input, index = residuals
    updated = _sparse_update(
        activation_grads,
        preprocessed_input,
        variables,
        step,
        index,
        config=config,
        path=select_path(config.mesh.devices.flat[0].platform),
    )
    return updated, None, None


# apply_gradients donates the variables. Run eagerly (a backward pass outside
# jit), that would free the residuals, which are the model's current tables;
# traced inside a jit of its own, which donates nothing, it frees nothing.
# `path` only keys the trace cache: apply_gradients picks the CPU kernels or
# the XLA path when traced, so a trace of one path must not serve the other.
@functools.partial(jax.jit, static_argnames=("config", "path"))
def _sparse_update(
    activation_grads, preprocessed_input, variables, step, index, *, config, path: LookupPath
):
    del path
    return embedding.apply_gradients(
        activation_grads,
        preprocessed_input,
        variables,
        config.feature_specs,
        config.mesh,
        step,
        enable_minibatching=config.enable_minibatching,
        layout_index=index,
    )


lookup.defvjp(_lookup_fwd, _lookup_bwd)
