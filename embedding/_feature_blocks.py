"""Between a stack's slot-major samples and its features' activation arrays.

A stack's lookup sums each slot's samples for all of its features in one
array, `float32[S, P, D]`, the features one after another along P; callers
get one `float32[S * n_f, dim_f]` array per feature, and the update takes
their gradients back. When the features of a stack are alike (one width,
the stack's, and one sample count per slot) the move is one transpose of
the whole block, each feature then a column block of a
`float32[S * n, F * D]` array: a caller that puts the features side by side
again in that order (the trainer's stacked activations) gets that array
back without a copy per feature, as XLA folds adjacent column slices into
the array they were cut from, and a concatenation of such slices into it.
Other stacks are cut and padded feature by feature.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from embedding._stack_geometry import StackGeometry


def _alike(g: StackGeometry) -> bool:
    """Every feature of the stack as wide as the stack and with as many samples
    per slot as the first, the features one after another in slot order."""
    n = g.features[0].samples_per_slot
    return all(
        f.dim == g.dim and f.samples_per_slot == n and f.sample_offset == k * n
        for k, f in enumerate(g.features)
    )


def feature_activations(total: jax.Array, g: StackGeometry) -> tuple[jax.Array, ...]:
    """Per feature of `g`, in `g.features` order, `float32[S * n_f, dim_f]`.

    Args:
      total: `float32[S, P, D]`, a device's pooled samples of the stack.
    """
    if not _alike(g):
        return tuple(
            total[:, f.sample_offset : f.sample_offset + f.samples_per_slot, : f.dim].reshape(
                -1, f.dim
            )
            for f in g.features
        )
    count, n, d = len(g.features), g.features[0].samples_per_slot, g.dim
    side_by_side = (
        total[:, : count * n].reshape(g.slots, count, n, d).transpose(0, 2, 1, 3)
    ).reshape(g.slots * n, count * d)
    return tuple(side_by_side[:, k * d : (k + 1) * d] for k in range(count))


def sample_gradients(grads: tuple[jax.Array, ...], g: StackGeometry) -> jax.Array:
    """`float32[S, sum of n_f, D]`: the features' activation gradients, slot by slot.

    Args:
      grads: per feature of `g`, in `g.features` order, `[S * n_f, dim_f]`.
    """
    grads = tuple(grad.astype(jnp.float32) for grad in grads)
    if not _alike(g):
        blocks = [
            jnp.pad(
                grad.reshape(g.slots, f.samples_per_slot, f.dim),
                ((0, 0), (0, 0), (0, g.dim - f.dim)),
            )
            for grad, f in zip(grads, g.features, strict=True)
        ]
        return jnp.concatenate(blocks, axis=1)
    count, n, d = len(g.features), g.features[0].samples_per_slot, g.dim
    side_by_side = jnp.concatenate(grads, axis=1).reshape(g.slots, n, count, d)
    return side_by_side.transpose(0, 2, 1, 3).reshape(g.slots, count * n, d)
