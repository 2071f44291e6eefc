"""Between a stack's slot-major samples and its features' activation arrays.

A stack's lookup sums each slot's samples for all of its features in one
array, `float32[S, P, D]`; callers get one `float32[S * n_f, dim_f]` array
per feature, and the update takes their gradients back. The layout numbers
a slot's samples feature after feature (sample `f * n + r` is example `r` of
feature `f`). When the features of a stack are alike (one width, the
stack's, and one sample count per slot) the lookup and the update place
sample `f * n + r` at `r * F + f` instead (`pooled_positions`), example by
example, so that the block is already a `float32[S * n, F * D]` array with
each feature a column block: a caller that puts the features side by side
again in that order (the trainer's stacked activations) gets that array
back without a copy, as XLA folds adjacent column slices into the array
they were cut from, and a concatenation of such slices into it (numbered as
the layout has them, the block took a transpose each way: docs/benchmarks.md).
Other stacks keep the layout's order and are cut and padded feature by
feature.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    # Annotations only: the lookup's paths import this, and `_stack_geometry` them.
    from embedding._stack_geometry import StackGeometry


def _alike(g: StackGeometry) -> bool:
    """Every feature of the stack as wide as the stack and with as many samples
    per slot as the first, the features one after another in slot order."""
    n = g.features[0].samples_per_slot
    return all(
        f.dim == g.dim and f.samples_per_slot == n and f.sample_offset == k * n
        for k, f in enumerate(g.features)
    )


def pooled_positions(samples: jax.Array, g: StackGeometry) -> jax.Array:
    """Where the lookup pools each sample and the update reads its gradient:
    for alike features, sample `f * n + r` at `r * F + f`; others, and ids
    outside `[0, F * n)` (padding), where they are.

    Args:
      samples: `int32[...]`, a device's sample ids of `g` in their slots.
    """
    if not _alike(g) or len(g.features) == 1:
        return samples
    count, n = len(g.features), g.features[0].samples_per_slot
    in_features = (samples >= 0) & (samples < count * n)
    return jnp.where(in_features, (samples % n) * count + samples // n, samples)


def feature_activations(total: jax.Array, g: StackGeometry) -> tuple[jax.Array, ...]:
    """Per feature of `g`, in `g.features` order, `float32[S * n_f, dim_f]`.

    Args:
      total: `float32[S, P, D]`, a device's pooled samples of the stack, at
        their `pooled_positions`.
    """
    if not _alike(g):
        return tuple(
            total[:, f.sample_offset : f.sample_offset + f.samples_per_slot, : f.dim].reshape(
                -1, f.dim
            )
            for f in g.features
        )
    count, n, d = len(g.features), g.features[0].samples_per_slot, g.dim
    side_by_side = total[:, : count * n].reshape(g.slots * n, count * d)
    return tuple(side_by_side[:, k * d : (k + 1) * d] for k in range(count))


def sample_gradients(grads: tuple[jax.Array, ...], g: StackGeometry) -> jax.Array:
    """`float32[S, sum of n_f, D]`: the features' activation gradients, slot by
    slot, at their samples' `pooled_positions`.

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
    return jnp.concatenate(grads, axis=1).reshape(g.slots, n * count, d)
