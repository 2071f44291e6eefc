"""Pipeline markers: an identity primitive that delimits pipeline layers.

Three kinds of marker exist. `mark_pipeline_boundary()` binds a BOUNDARY
marker with no operands: it only records a position in the traced program.
Layer construction turns the boundaries into START/END markers around each
layer: a START marker passes every value the layer reads from outside it, an
END marker every value the layer produces for later layers.

Every marker is the identity in evaluation, lowering and batching. Under
autodiff the tangents go through a marker with the same parameters, and the
transpose of a START marker is an END marker of the same layer (and the
reverse) with `backward=True`, so the backward computation of layer `l`
appears in the differentiated program between
`marker[layer=l, kind=START, backward=True]` (the cotangents of the layer's
outputs) and `marker[layer=l, kind=END, backward=True]` (the cotangents of its
inputs, parameters included).
"""

from __future__ import annotations

import enum

from jax.extend.core import JaxprEqn, Primitive
from jax.interpreters import ad, batching, mlir


class MarkerKind(enum.Enum):
    """What a pipeline marker delimits."""

    BOUNDARY = "boundary"
    START = "start"
    END = "end"


_TRANSPOSED_KIND = {
    MarkerKind.START: MarkerKind.END,
    MarkerKind.END: MarkerKind.START,
    MarkerKind.BOUNDARY: MarkerKind.BOUNDARY,
}

pipeline_marker_p = Primitive("pipeline_marker")
pipeline_marker_p.multiple_results = True
pipeline_marker_p.def_impl(lambda *values, **_: list(values))
pipeline_marker_p.def_abstract_eval(lambda *avals, **_: list(avals))
mlir.register_lowering(pipeline_marker_p, lambda ctx, *values, **_: list(values))


def _batch_rule(values, dims, **params):
    return pipeline_marker_p.bind(*values, **params), dims


def _bind_nonzero(values, **params):
    """Marks the values that are not symbolic zeros; zeros pass unmarked.

    Symbolic zeros (the tangents of integer inputs, parameters the loss does
    not depend on) carry no data, so the marker only sees real values; the
    layer mapping lives in the parameters, not in the operand count.
    """
    nonzero = [v for v in values if not isinstance(v, ad.Zero)]
    marked = iter(pipeline_marker_p.bind(*nonzero, **params) if nonzero else ())
    return [v if isinstance(v, ad.Zero) else next(marked) for v in values]


def _jvp_rule(primals, tangents, *, layer, kind, backward):
    params = dict(layer=layer, kind=kind, backward=backward)
    return pipeline_marker_p.bind(*primals, **params), _bind_nonzero(tangents, **params)


def _transpose_rule(cotangents, *operands, layer, kind, backward):
    del operands  # The marker is linear in every operand.
    return _bind_nonzero(
        cotangents, layer=layer, kind=_TRANSPOSED_KIND[kind], backward=not backward
    )


batching.primitive_batchers[pipeline_marker_p] = _batch_rule
ad.primitive_jvps[pipeline_marker_p] = _jvp_rule
ad.primitive_transposes[pipeline_marker_p] = _transpose_rule


def mark_pipeline_boundary() -> None:
    """Marks the boundary between two pipeline layers of the model.

    Call it inside the loss function given to `pipeshard.value_and_grad` (or
    `pipeshard.grad`), between the computations of two layers, with
    `layer_option="manual"`. Outside `pipeshard.parallelize` it does nothing,
    so the same model runs unchanged under `jax.jit` or `jax.grad`.

    It must not be called inside `lax.cond`, `lax.while_loop`, `lax.scan`,
    `jax.checkpoint` or a custom-derivative function: a layer boundary must
    be a single point of the program.

    Example:
      def loss_fn(params, batch):
          h = jax.nn.relu(batch["x"] @ params["w0"])
          pipeshard.mark_pipeline_boundary()
          return jnp.mean((h @ params["w1"] - batch["y"]) ** 2)
    """
    pipeline_marker_p.bind(layer=-1, kind=MarkerKind.BOUNDARY, backward=False)


def mark_layer(values, *, layer: int, kind: MarkerKind) -> list:
    """Passes `values` through a forward START or END marker of `layer`."""
    return pipeline_marker_p.bind(*values, layer=layer, kind=kind, backward=False)


def is_marker(eqn: JaxprEqn, kind: MarkerKind | None = None) -> bool:
    """Whether `eqn` is a pipeline marker (of `kind`, when given)."""
    return eqn.primitive is pipeline_marker_p and (kind is None or eqn.params["kind"] is kind)
