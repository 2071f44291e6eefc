"""Small tools over jaxprs: evaluating equations, finding markers, costs."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var, jaxprs_in_params
from jax.extend.core import primitives as prims

from parallel.pipeshard._markers import is_marker

# Call-like primitives whose body may be inlined without changing meaning.
_INLINABLE = (prims.jit_p, prims.closed_call_p, prims.call_p)


def read_atom(env: Mapping[Var, Any], atom) -> Any:
    """Value of a jaxpr atom: a literal's value or the variable's in `env`."""
    return atom.val if isinstance(atom, Literal) else env[atom]


def eval_eqn(eqn: JaxprEqn, invals: Sequence[Any]) -> list:
    """Binds `eqn`'s primitive on `invals` (under the current trace)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def eval_eqns(eqns: Iterable[JaxprEqn], env: dict[Var, Any]) -> None:
    """Evaluates `eqns` in order, reading and writing `env` in place."""
    for eqn in eqns:
        outs = eval_eqn(eqn, [read_atom(env, v) for v in eqn.invars])
        for var, value in zip(eqn.outvars, outs):
            if not isinstance(var, DropVar):
                env[var] = value


def vars_of(atoms: Iterable[Any]) -> list[Var]:
    """The variables among `atoms` (literals dropped), in order."""
    return [a for a in atoms if isinstance(a, Var) and not isinstance(a, DropVar)]


def contains_marker(jaxpr: Jaxpr) -> bool:
    """Whether a pipeline marker appears in `jaxpr` or any jaxpr nested in it."""
    return any(eqn_contains_marker(eqn) for eqn in jaxpr.eqns)


def eqn_contains_marker(eqn: JaxprEqn) -> bool:
    """Whether `eqn` is a pipeline marker or has one in a nested jaxpr."""
    return is_marker(eqn) or any(contains_marker(sub) for sub in jaxprs_in_params(eqn.params))


def check_marker_placement(jaxpr: Jaxpr) -> None:
    """Rejects markers where a layer boundary has no single position.

    Raises:
      ValueError: a marker sits inside control flow (cond, while, scan), a
        rematerialized function, or a custom-derivative function.
    """
    for eqn in jaxpr.eqns:
        subs = [sub for sub in jaxprs_in_params(eqn.params) if contains_marker(sub)]
        if subs and eqn.primitive not in _INLINABLE:
            raise ValueError(
                f"mark_pipeline_boundary() is called inside `{eqn.primitive.name}` (control "
                "flow, jax.checkpoint or a custom-derivative function); a layer boundary must "
                "be at the top level of the loss. Move the marker out of it, e.g. unroll the "
                "loop over layers in Python."
            )
        for sub in subs:
            check_marker_placement(sub)


def inline_marked_calls(jaxpr: Jaxpr, in_avals: Sequence[Any]) -> ClosedJaxpr:
    """Retraces `jaxpr` with every call that contains a marker inlined.

    Markers inside `jax.jit`-ed functions are brought to the top level so
    that layers can be cut there. The result takes `jaxpr`'s invars followed
    by its constvars as inputs, whose types `in_avals` gives.

    Raises:
      ValueError: a marker in a place `check_marker_placement` rejects.
    """
    check_marker_placement(jaxpr)

    def evaluate(jaxpr: Jaxpr, consts, *args):
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            invals = [read_atom(env, v) for v in eqn.invars]
            if eqn.primitive in _INLINABLE and eqn_contains_marker(eqn):
                inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                if isinstance(inner, ClosedJaxpr):
                    outs = evaluate(inner.jaxpr, inner.consts, *invals)
                else:
                    outs = evaluate(inner, (), *invals)
            else:
                outs = eval_eqn(eqn, invals)
            for var, value in zip(eqn.outvars, outs):
                if not isinstance(var, DropVar):
                    env[var] = value
        return [read_atom(env, v) for v in jaxpr.outvars]

    num_args = len(jaxpr.invars)

    def flat(*args):
        return evaluate(jaxpr, args[num_args:], *args[:num_args])

    return jax.make_jaxpr(flat)(*in_avals)


def nbytes(aval) -> int:
    """Bytes of an array of abstract value `aval`."""
    return int(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


def eqn_flops(eqn: JaxprEqn) -> float:
    """Approximate floating-point operations of one equation.

    Matrix products and convolutions count two per multiply-add; nested
    programs count their bodies (times the trip count of a scan); every other
    operation counts one per output element.
    """
    name = eqn.primitive.name
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs_shape = eqn.invars[0].aval.shape
        contracted = math.prod(lhs_shape[d] for d in lhs_contract)
        return 2.0 * math.prod(eqn.outvars[0].aval.shape) * contracted
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval
        out_features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
        return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs.shape) / out_features
    subs = list(jaxprs_in_params(eqn.params))
    if subs:
        trips = eqn.params.get("length", 1) if name == "scan" else 1
        return trips * sum(eqn_flops(e) for sub in subs for e in sub.eqns)
    return float(sum(math.prod(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")))
