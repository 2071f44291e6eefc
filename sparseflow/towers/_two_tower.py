"""`TwoTower`: a retrieval model, user and item towers trained by in-batch softmax.

The model follows Yi et al. 2019, "Sampling-bias-corrected neural modeling
for large corpus item recommendations": each tower is an MLP over its own
features' activations, ending in a unit vector; the logit of user i and
item j is `<u_i, v_j> / T - log q(item_j)`; every example's own item is its
positive and the batch's other items are its negatives.

Why the log-Q correction: the batch's items are a sample of the training
interactions, so an item is a negative about `q(item)` times as often as a
uniform sample would make it; uncorrected, the softmax learns to push
popular items down. Subtracting `log q` makes the in-batch softmax an
estimate of the full softmax over all items.

Why `q` comes as a dense value of each record (`log_q_column`): the share of
the training interactions is known exactly when the data is written
(`sparseflow.retrieval.write_interactions` writes it), it travels with the
example through shuffling, pipelining and resume with no state of its own,
and the trainer carries nnx.Params only, so a streaming frequency estimate
(the paper's hashed arrays of last-seen steps) would have no place in its
checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import embedding
from embedding.nnx import Embed
from sparseflow.towers._tower import _feature_dims

# Below it, a vector is scaled by 1e12 instead of to unit length (zero stays zero).
_MIN_SQUARED_NORM = 1e-24


def in_batch_softmax_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """The softmax cross-entropy of every row against its diagonal, averaged over
    the rows whose label is 1.

    Rows of label 0 (records that are not interactions) add no term, though
    their items stay in the other rows' softmax as negatives. A batch holding
    an item twice counts its other copy as a negative, as Yi et al. do; the
    log-Q correction accounts for how often that happens to each item.

    Args:
      logits: `float32[batch, batch]`, row i the user of example i against
        every example's item.
      labels: `int32[batch]`, 0 or 1.

    Returns:
      `float32[]`; 0 for a batch without a label 1.
    """
    log_softmax = jax.nn.log_softmax(logits, axis=1)
    weights = labels.astype(log_softmax.dtype)
    return -jnp.sum(weights * jnp.diagonal(log_softmax)) / jnp.maximum(jnp.sum(weights), 1)


class TwoTower(nnx.Module):
    """A two-tower retrieval model over an `Embed` layer.

    Called on a batch it returns the in-batch logits `float32[batch, batch]`
    (row i: user i against every item of the batch, log-Q corrected), which
    its `loss` (`in_batch_softmax_loss`) trains: the trainer finds the loss
    on the class, so `model.module: "sparseflow.towers:TwoTower"` needs no
    more. `user_vectors` and `item_vectors` run one tower on activations, for
    retrieval (`sparseflow.retrieval`).

    Attributes:
      embed: the `Embed` layer.
      user_tower, item_tower: `nnx.Linear` layers, ReLU between them.
      user_features, item_features: each tower's features, in input order.
      temperature: T, dividing the cosine similarities.
      log_q_column: the column of the dense input holding `log q(item)`, or
        None (no correction).
    """

    loss = staticmethod(in_batch_softmax_loss)

    def __init__(
        self,
        embed: Embed,
        num_dense_features: int,
        *,
        user_features: Sequence[str],
        item_features: Sequence[str],
        hidden: Sequence[int] = (64,),
        dim: int = 32,
        temperature: float = 0.05,
        log_q_column: int | None = 0,
        rngs: nnx.Rngs,
    ):
        """Creates both towers for `embed`'s features.

        Args:
          embed: an `Embed` layer over a dict of feature specs by feature name.
          num_dense_features: the width of the dense input.
          user_features: the features of the user tower (e.g. `["user_id"]`).
          item_features: the features of the item tower (e.g. `["item_id"]`);
            no feature in both.
          hidden: hidden widths of each tower's MLP (may be empty: one layer).
          dim: the width of the user and item vectors.
          temperature: T > 0; the logits of unit vectors span `[-1/T, 1/T]`.
          log_q_column: the dense input's column of `log q(item)` (the item's
            share of the training interactions); None trains without the
            correction.
          rngs: the towers' initializers get `rngs.params()`.

        Raises:
          TypeError: `embed` is not an `Embed` layer over a dict of feature specs.
          ValueError: a feature not in `embed` or in both towers; a width,
            `temperature` or `log_q_column` out of range.
        """
        dims = _feature_dims(embed)
        self.user_features = _tower_features("user_features", user_features, dims)
        self.item_features = _tower_features("item_features", item_features, dims)
        both = sorted(set(self.user_features) & set(self.item_features))
        if both:
            raise ValueError(
                f"{both} are in both user_features and item_features; give each one tower."
            )
        widths = [*hidden, dim]
        if not all(isinstance(w, int) and w > 0 for w in widths):
            raise ValueError(
                f"hidden and dim must be positive ints, got hidden={list(hidden)}, dim={dim}."
            )
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}.")
        if log_q_column is not None and not 0 <= log_q_column < num_dense_features:
            raise ValueError(
                f"log_q_column={log_q_column} is not a column of the {num_dense_features} dense "
                "features; point it at the column of log q(item), or pass None to train "
                "without the log-Q correction."
            )
        self.embed = embed
        self.user_tower = _mlp(sum(dims[f] for f in self.user_features), widths, rngs)
        self.item_tower = _mlp(sum(dims[f] for f in self.item_features), widths, rngs)
        self.temperature = float(temperature)
        self.log_q_column = log_q_column

    def __call__(self, sparse_batch: embedding.PreprocessedInput | None, dense: jax.Array):
        """The in-batch logits of B interactions.

        Args:
          sparse_batch: the interactions' ids, preprocessed for `embed` (None
            when the trainer hands the layer its activations).
          dense: `float32[B, num_dense_features]`, `log q(item)` in column
            `log_q_column`.

        Returns:
          `float32[B, B]`: `[i, j] = <u_i, v_j> / T - log q(item_j)`.
        """
        activations = self.embed(sparse_batch)
        logits = self.user_vectors(activations) @ self.item_vectors(activations).T
        logits = logits / self.temperature
        if self.log_q_column is None:
            return logits
        return logits - dense[None, :, self.log_q_column]

    def user_vectors(self, activations: Mapping[str, jax.Array]) -> jax.Array:
        """`float32[n, dim]` unit vectors of the user tower on per-feature
        activations `float32[n, embedding_dim]` (others in the dict are ignored)."""
        return _tower(self.user_tower, activations, self.user_features)

    def item_vectors(self, activations: Mapping[str, jax.Array]) -> jax.Array:
        """`float32[n, dim]` unit vectors of the item tower, as `user_vectors`."""
        return _tower(self.item_tower, activations, self.item_features)


def _tower_features(name: str, features: Sequence[str], dims: Mapping[str, int]) -> tuple[str, ...]:
    if isinstance(features, str) or not features:
        raise ValueError(f"{name} must be a non-empty list of feature names, got {features!r}.")
    unknown = sorted(set(features) - set(dims))
    if unknown:
        raise ValueError(
            f"{name} names {unknown}, not features of the Embed layer ({sorted(dims)})."
        )
    return tuple(features)


def _mlp(width: int, widths: Sequence[int], rngs: nnx.Rngs) -> nnx.List:
    fan_ins = [width, *widths[:-1]]
    return nnx.List([nnx.Linear(i, o, rngs=rngs) for i, o in zip(fan_ins, widths, strict=True)])


def _tower(layers: nnx.List, activations: Mapping[str, jax.Array], features: Sequence[str]):
    x = jnp.concatenate([activations[name] for name in features], axis=1)
    for layer in layers[:-1]:
        x = nnx.relu(layer(x))
    x = layers[-1](x)
    # A unit vector: the logits are cosines over T, bounded whatever the norms.
    # Through the squared norm, whose gradient at a zero vector (a user with no
    # ids in any feature, say) is 0, where the norm's is NaN.
    squared = jnp.sum(x * x, axis=1, keepdims=True)
    return x * jax.lax.rsqrt(jnp.maximum(squared, _MIN_SQUARED_NORM))
