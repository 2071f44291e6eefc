"""The lookup of one unsharded table, in plain JAX: what a served model runs.

It combines a row's ids as `sparse_dense_matmul` does on the sharded tables
(`_feature_input._gains`): each id's embedding times its gain, summed, with
gain = weight (sum), weight / sum of the row's weights (mean), or weight /
sqrt of the sum of their squares (sqrtn); a row whose weights are all zero
gives zeros. Rows are padded to one length with weight 0, which adds nothing.
Gathers and sums only: no custom call, so it exports (`jax.export`) and
converts (`jax2tf`) as it is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from embedding._specs import Combiner


def dense_lookup(
    table: jax.Array, ids: jax.Array, weights: jax.Array, combiner: Combiner | str
) -> jax.Array:
    """Combined embeddings of padded rows of ids.

    Args:
      table: `float32[vocabulary_size, dim]`, one table in vocabulary order.
      ids: `int32[batch, length]`, each in `[0, vocabulary_size)` (padding: any
        valid id, e.g. 0).
      weights: `float32[batch, length]`, each >= 0; 0 for padding.
      combiner: "sum", "mean" or "sqrtn".

    Returns:
      `float32[batch, dim]`.
    """
    combiner = Combiner(combiner)
    gains = weights
    if combiner is not Combiner.SUM:
        squares = combiner is Combiner.SQRTN
        total = jnp.sum(weights * weights if squares else weights, axis=1, keepdims=True)
        denominator = jnp.sqrt(total) if squares else total
        safe = jnp.where(denominator > 0, denominator, 1.0)
        gains = jnp.where(denominator > 0, weights / safe, 0.0)
    return jnp.einsum("bl,bld->bd", gains, jnp.take(table, ids, axis=0))
