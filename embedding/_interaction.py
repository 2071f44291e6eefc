"""DLRM's feature interaction: the dot products of every pair of a sample's vectors.

On CPU, when the kernels build (`_cpu_kernels`), forward and backward run
in kernels that compute 16 samples at once, one per vector lane, at about
half the CPU time of XLA's batched products (docs/benchmarks.md). Elsewhere,
or with `SPARSEFLOW_CPU_KERNELS=0`, XLA computes the Gram matrices and
takes their upper triangles (`_xla_pairwise_dots`, also the kernels'
reference in the tests).

Under a partitioned `jax.jit` the kernels run on each device's samples
(`custom_partitioning`): a custom call the partitioner cannot split would
make every device compute the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from embedding import _cpu_kernels


def pairwise_dots(vectors: Sequence[jax.Array]) -> jax.Array:
    """The dot products of every pair of vectors, in `np.triu_indices(n, k=1)` order.

    Args:
      vectors: n arrays `float32[batch, d]`.

    Returns:
      `float32[batch, n (n - 1) / 2]`: `[v0.v1, v0.v2, .., v0.v(n-1), v1.v2, ..]`.
    """
    stacked = _stack(vectors)
    if stacked.dtype != jnp.float32 or not _cpu_kernels.enabled("cpu"):
        return _xla_pairwise_dots(stacked)
    return _kernel_pairwise_dots(stacked)


def _stack(vectors: Sequence[jax.Array]) -> jax.Array:
    """`float32[batch, n, d]`: the vectors side by side.

    Concatenated along their last axis and then reshaped, not `jnp.stack`ed:
    vectors that are consecutive column slices of one array (the lookup's
    activations as the trainer unstacks them) then fold back into that array
    in XLA, where stacking copied each one out and back (a copy per feature
    forward, and one per feature for the gradient).
    """
    if len({v.shape for v in vectors}) != 1 or vectors[0].ndim != 2:
        return jnp.stack(vectors, axis=1)
    batch, d = vectors[0].shape
    return jnp.concatenate(vectors, axis=1).reshape(batch, len(vectors), d)


def _pair_indices(n: int) -> tuple[np.ndarray, np.ndarray]:
    """`(flat index in [n, n] of each pair, pair index of each of the n x n places)`.

    The second maps both (i, j) and (j, i) to the pair's index, and the
    diagonal to n (n - 1) / 2, one past the last pair.
    """
    rows, cols = np.triu_indices(n, k=1)
    pairs = np.arange(rows.size)
    places = np.full((n, n), rows.size)
    places[rows, cols] = pairs
    places[cols, rows] = pairs
    return rows * n + cols, places.reshape(-1)


def _xla_forward(stacked: jax.Array) -> jax.Array:
    n = stacked.shape[1]
    gram = jnp.einsum("bid,bjd->bij", stacked, stacked)
    upper, _ = _pair_indices(n)
    return jnp.take(gram.reshape(-1, n * n), upper, axis=1)


def _xla_transpose(stacked: jax.Array, grads: jax.Array) -> jax.Array:
    n = stacked.shape[1]
    _, places = _pair_indices(n)
    padded = jnp.concatenate([grads, jnp.zeros_like(grads[:, :1])], axis=1)
    symmetric = jnp.take(padded, places, axis=1).reshape(-1, n, n)
    return jnp.einsum("bij,bjd->bid", symmetric, stacked)


@jax.custom_vjp
def _xla_pairwise_dots(stacked: jax.Array) -> jax.Array:
    """`pairwise_dots` of `stacked: float32[batch, n, d]` in XLA, with a gradient of its own.

    Autodiff of the Gram matrix and its upper triangle gives two batched
    products and a scatter of the triangle's gradient. The gradient here is
    one batched product with the symmetric matrix of the pairs' gradients,
    gathered in place (a gather, not a scatter), in less than half of
    autodiff's time forward and backward (docs/benchmarks.md).
    """
    return _xla_forward(stacked)


_xla_pairwise_dots.defvjp(
    lambda stacked: (_xla_forward(stacked), stacked),
    lambda stacked, grads: (_xla_transpose(stacked, grads),),
)


def _split_like_samples(mesh, arg_shapes, rank: int) -> NamedSharding:
    """A sharding of a rank-`rank` array split along its first axis as the first
    operand is split along its own (the samples), whole along the others."""
    spec = arg_shapes[0].sharding.spec
    samples = spec[0] if len(spec) else None
    return NamedSharding(mesh, PartitionSpec(samples, *[None] * (rank - 1)))


def _partitioned(kernel, rule: str):
    """`kernel` under `custom_partitioning`: its operands come in split by
    samples as the first one is (whatever the partitioner suggests), and each
    device runs the kernel on its samples."""

    def partition(mesh, arg_shapes, result_shape):
        arg_shardings = tuple(
            _split_like_samples(mesh, arg_shapes, len(shape.shape)) for shape in arg_shapes
        )
        result_sharding = _split_like_samples(mesh, arg_shapes, len(result_shape.shape))
        return mesh, kernel, result_sharding, arg_shardings

    def infer(mesh, arg_shapes, result_shape):
        return _split_like_samples(mesh, arg_shapes, len(result_shape.shape))

    wrapped = custom_partitioning(kernel)
    wrapped.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule)
    return wrapped


_partitioned_dots = _partitioned(_cpu_kernels.pairwise_dots, "b n d -> b p")
_partitioned_transpose = _partitioned(_cpu_kernels.pairwise_dots_transpose, "b n d, b p -> b n d")


def _kernel_forward(stacked: jax.Array) -> jax.Array:
    return jax.lax.platform_dependent(stacked, cpu=_partitioned_dots, default=_xla_forward)


def _kernel_transpose(stacked: jax.Array, grads: jax.Array) -> jax.Array:
    return jax.lax.platform_dependent(
        stacked, grads, cpu=_partitioned_transpose, default=_xla_transpose
    )


@jax.custom_vjp
def _kernel_pairwise_dots(stacked: jax.Array) -> jax.Array:
    """`pairwise_dots` of `stacked: float32[batch, n, d]` in the CPU kernels
    (XLA's on other platforms)."""
    return _kernel_forward(stacked)


_kernel_pairwise_dots.defvjp(
    lambda stacked: (_kernel_forward(stacked), stacked),
    lambda stacked, grads: (_kernel_transpose(stacked, grads),),
)
