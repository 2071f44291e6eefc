"""Pipeline markers: identity everywhere, layer mapping kept under autodiff."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pipeshard_models import mlp_batch, mlp_init, mlp_loss

from parallel import pipeshard
from parallel.pipeshard import MarkerKind, pipeline_marker_p


def _mark(values, layer, kind):
    return pipeline_marker_p.bind(*values, layer=layer, kind=kind, backward=False)


def _two_layers(w, x):
    """Layer 0: tanh(x @ w); layer 1: sum of squares."""
    w0, x0 = _mark([w, x], 0, MarkerKind.START)
    (h,) = _mark([jnp.tanh(x0 @ w0)], 0, MarkerKind.END)
    (h1,) = _mark([h], 1, MarkerKind.START)
    (out,) = _mark([jnp.sum(h1**2)], 1, MarkerKind.END)
    return out


def _plain(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


W = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
X = np.linspace(0, 2, 8, dtype=np.float32).reshape(2, 4)


@pytest.mark.parametrize(
    "transform",
    [
        lambda f: f,
        jax.jit,
        lambda f: jax.grad(f, argnums=(0, 1)),
        lambda f: jax.jit(jax.value_and_grad(f)),
        lambda f: jax.vmap(f, in_axes=(None, 0)),
        lambda f: jax.jacfwd(f),
    ],
    ids=["eval", "jit", "grad", "jit_value_and_grad", "vmap", "jacfwd"],
)
def test_markers_are_identity(transform):
    got, want = transform(_two_layers)(W, X), transform(_plain)(W, X)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6), got, want)


def test_boundary_is_a_no_op_under_jax_transformations():
    rng = np.random.default_rng(0)
    params, batch = mlp_init(rng), mlp_batch(rng)
    with_markers = jax.jit(jax.value_and_grad(mlp_loss))(params, batch)

    def without_markers(params, batch):
        h = batch["x"]
        for i in range(4):
            h = jnp.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
        return jnp.mean((h - batch["y"]) ** 2)

    want = jax.jit(jax.value_and_grad(without_markers))(params, batch)
    jax.tree.map(lambda g, w: np.testing.assert_array_equal(g, w), with_markers, want)


def _markers_in(jaxpr):
    return [
        (e.params["layer"], e.params["kind"], e.params["backward"], len(e.invars))
        for e in jaxpr.eqns
        if e.primitive is pipeline_marker_p
    ]


def test_transpose_maps_backward_layers_to_forward_layers():
    """Backward layer l opens with the transposed END and closes with the transposed START."""
    jaxpr = jax.make_jaxpr(jax.grad(_two_layers))(W, X).jaxpr
    start, end = MarkerKind.START, MarkerKind.END
    assert _markers_in(jaxpr) == [
        (0, start, False, 2),
        (0, end, False, 1),
        (1, start, False, 1),
        (1, end, False, 1),
        (1, start, True, 1),  # cotangent of the loss
        (1, end, True, 1),  # cotangent of h
        (0, start, True, 1),
        (0, end, True, 1),  # cotangent of w only: x is not differentiated
    ]


def test_backward_layer_holds_its_own_operations():
    """Between layer 0's backward markers sit the transposes of tanh(x @ w)."""
    eqns = jax.make_jaxpr(jax.grad(_two_layers))(W, X).jaxpr.eqns
    marks = [i for i, e in enumerate(eqns) if e.primitive is pipeline_marker_p]
    inside = {e.primitive.name for e in eqns[marks[6] + 1 : marks[7]]}
    assert "dot_general" in inside and "mul" in inside


def test_jvp_marks_tangents_with_the_same_layer():
    jaxpr = jax.make_jaxpr(lambda w, t: jax.jvp(lambda v: _two_layers(v, X), (w,), (t,)))(W, W)
    forward = [m for m in _markers_in(jaxpr.jaxpr) if not m[2]]
    assert [m[:2] for m in forward] == [(0, MarkerKind.START)] * 2 + [(0, MarkerKind.END)] * 2 + [
        (1, MarkerKind.START)
    ] * 2 + [(1, MarkerKind.END)] * 2


def test_integer_operands_pass_without_tangents():
    def f(w, ids):
        w_marked, ids_marked = _mark([w, ids], 0, MarkerKind.START)
        return jnp.sum(w_marked[ids_marked])

    ids = np.array([0, 2, 2], np.int32)
    np.testing.assert_allclose(jax.grad(f)(W, ids), jax.grad(lambda w, i: jnp.sum(w[i]))(W, ids))


def test_boundary_marker_binds_no_values():
    jaxpr = jax.make_jaxpr(lambda: pipeshard.mark_pipeline_boundary())().jaxpr
    assert _markers_in(jaxpr) == [(-1, MarkerKind.BOUNDARY, False, 0)]
