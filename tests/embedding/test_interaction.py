"""DLRM's pairwise interaction: the CPU kernels and XLA's path against float64."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import embedding
from embedding import _cpu_kernels, _interaction


def _float64_reference(vectors: list[np.ndarray], weights: np.ndarray):
    """The dots, and the gradient of sum(weights * dots), by hand: for pair
    p = (i, j), d/dv_i = sum_j w_p v_j."""
    v64 = [v.astype(np.float64) for v in vectors]
    pairs = list(itertools.combinations(range(len(vectors)), 2))
    dots = np.stack([np.sum(v64[i] * v64[j], axis=1) for i, j in pairs], axis=1)
    grads = [np.zeros_like(v) for v in v64]
    for p, (i, j) in enumerate(pairs):
        grads[i] += weights[:, p : p + 1] * v64[j]
        grads[j] += weights[:, p : p + 1] * v64[i]
    return dots, grads


# Batches below, at and past a block of 16 samples; widths the kernels know
# at compile time (16) and not (5, 3), and counts of vectors with and
# without a tail after groups of 8 pairs.
@pytest.mark.parametrize(
    ("batch", "n", "d"), [(3, 5, 4), (16, 9, 16), (37, 27, 16), (50, 12, 5), (17, 2, 3)]
)
def test_dots_and_their_gradient_match_float64(lookup_path, batch, n, d):
    rng = np.random.default_rng(batch * n * d)
    vectors = [rng.normal(size=(batch, d)).astype(np.float32) for _ in range(n)]
    weights = rng.normal(size=(batch, n * (n - 1) // 2)).astype(np.float32)
    want, want_grads = _float64_reference(vectors, weights)

    def loss(vs):
        return (embedding.pairwise_dots(vs) * weights).sum()

    # A new function each time: jit's cache must not hand one path's program to the other.
    forward = jax.jit(lambda vs: embedding.pairwise_dots(vs))
    backward = jax.jit(jax.grad(loss))
    lowered = backward.lower(vectors).as_text()
    assert ("sparseflow_pairwise_dots_transpose" in lowered) == (lookup_path == "cpu_kernels")
    got = np.asarray(forward(vectors))
    grads = backward(vectors)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("cpu_kernels")
def test_the_kernels_run_on_each_devices_samples():
    """Under a jit partitioned over 8 devices, each device's kernel gets its own
    64 samples (no gathered batch), and the results are XLA's."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("devices",))
    split = NamedSharding(mesh, PartitionSpec("devices"))
    rng = np.random.default_rng(0)
    stacked = jax.device_put(rng.normal(size=(512, 27, 16)).astype(np.float32), split)
    weights = jax.device_put(rng.normal(size=(512, 351)).astype(np.float32), split)

    def step(dots):
        return jax.jit(jax.value_and_grad(lambda x, w: (dots(x) * w).sum()))

    kernels = step(_interaction._kernel_pairwise_dots)
    compiled = kernels.lower(stacked, weights).compile().as_text()
    calls = [
        line for line in compiled.splitlines() if 'custom_call_target="sparseflow_pair' in line
    ]
    assert len(calls) == 2 and all("f32[64,27,16]" in line for line in calls), calls
    assert "all-gather" not in compiled

    loss, grads = kernels(stacked, weights)
    want_loss, want_grads = step(_interaction._xla_pairwise_dots)(stacked, weights)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grads), np.asarray(want_grads), rtol=1e-5, atol=1e-5)
    assert grads.sharding.spec == PartitionSpec("devices")


def test_other_dtypes_take_xla_path():
    vectors = [jnp.ones((4, 2), jnp.bfloat16), 2 * jnp.ones((4, 2), jnp.bfloat16)]
    dots = embedding.pairwise_dots(vectors)
    assert dots.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(dots, np.float32), np.full((4, 1), 4.0))


def test_a_program_traced_without_the_cpu_kernels_holds_no_custom_call():
    """What `jax.export` and `jax2tf` need of an exported forward."""
    x = jax.ShapeDtypeStruct((32, 16), jnp.float32)

    def lowered() -> str:
        # A new function each time: jit would reuse the first trace.
        return jax.jit(lambda a, b, c: embedding.pairwise_dots([a, b, c])).lower(x, x, x).as_text()

    with embedding.without_cpu_kernels():
        assert "custom_call" not in lowered()
    if _cpu_kernels.enabled("cpu"):  # and with them, on CPU, the kernel's call is there
        assert "custom_call" in lowered()
