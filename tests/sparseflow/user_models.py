"""Flax NNX models of a user, for `model.module` in the training tests."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


class LinearModel(nnx.Module):
    """Logits `[activations of every feature in name order, dense] @ w + b`."""

    def __init__(self, embed, num_dense_features: int, *, rngs: nnx.Rngs, scale: float = 1.0):
        self.embed = embed
        width = sum(s.table_spec.embedding_dim for s in embed.feature_specs.values())
        self.head = nnx.Linear(width + num_dense_features, 1, rngs=rngs)
        self.scale = scale

    def __call__(self, sparse_batch, dense):
        activations = self.embed(sparse_batch)
        x = jnp.concatenate([activations[name] for name in sorted(activations)] + [dense], 1)
        return self.scale * self.head(x)[:, 0]


class WithoutTheLayer(nnx.Module):
    """Drops the layer it is given."""

    def __init__(self, embed, num_dense_features: int, *, rngs: nnx.Rngs):
        self.head = nnx.Linear(num_dense_features, 1, rngs=rngs)

    def __call__(self, sparse_batch, dense):
        return self.head(dense)[:, 0]


class ColumnLogits(LinearModel):
    """Returns `[batch, 1]` logits instead of `[batch]`."""

    def __call__(self, sparse_batch, dense):
        return super().__call__(sparse_batch, dense)[:, None]


class WithBatchStats(LinearModel):
    """Holds a `BatchStat`, which the trainer does not carry."""

    def __init__(self, embed, num_dense_features: int, *, rngs: nnx.Rngs):
        super().__init__(embed, num_dense_features, rngs=rngs)
        self.count = nnx.BatchStat(jnp.zeros(()))
