"""Flax NNX models of a user, for `model.module` in the training tests."""

from __future__ import annotations

import jax
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


class LinearMeanOverExamples(LinearModel):
    """Says that its loss (the default) is a mean over examples of their own logits."""

    mean_over_examples = True


class MeanOverExamplesNotABool(LinearModel):
    mean_over_examples = "yes"


class WithBatchStats(LinearModel):
    """Holds a `BatchStat`, which the trainer does not carry."""

    def __init__(self, embed, num_dense_features: int, *, rngs: nnx.Rngs):
        super().__init__(embed, num_dense_features, rngs=rngs)
        self.count = nnx.BatchStat(jnp.zeros(()))


class PairLogits(nnx.Module):
    """Returns `[batch, batch]` logits (every example's first feature against every
    example's second), trained by its own loss: each row's softmax against its diagonal."""

    def __init__(self, embed, num_dense_features: int, *, rngs: nnx.Rngs):
        self.embed = embed
        self.first, self.second = sorted(embed.feature_specs)[:2]
        dims = [
            embed.feature_specs[name].table_spec.embedding_dim for name in (self.first, self.second)
        ]
        self.project = nnx.Linear(dims[0], dims[1], rngs=rngs)

    def __call__(self, sparse_batch, dense):
        activations = self.embed(sparse_batch)
        return self.project(activations[self.first]) @ activations[self.second].T

    @staticmethod
    def loss(logits, labels):
        return -jnp.mean(jnp.diagonal(jax.nn.log_softmax(logits, axis=1)))


class PairLogitsVectorLoss(PairLogits):
    """Its loss returns one value per example instead of a scalar."""

    @staticmethod
    def loss(logits, labels):
        return jnp.diagonal(logits)


class PairLogitsMismatchedLoss(PairLogits):
    """Its loss multiplies shapes that do not match."""

    @staticmethod
    def loss(logits, labels):
        return jnp.sum(logits @ labels[:3])
