"""Layer construction: cutting the traced forward program into layers.

Layers are contiguous runs of the forward program's equations, cut either
at the boundary markers (manual) or by cost (automatic). `layered_function`
re-evaluates the program with every layer wrapped in START/END markers, so
that differentiating it yields a program whose backward layers are marked
too (see `_markers`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import numpy as np
from jax.extend.core import ClosedJaxpr, Var

from parallel.pipeshard._jaxprs import eqn_flops, eval_eqns, nbytes, read_atom, vars_of
from parallel.pipeshard._markers import MarkerKind, is_marker, mark_layer
from parallel.pipeshard._options import AutoLayerOption, LayerOption, ManualLayerOption

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerAssignment:
    """The layer of every equation of a forward program.

    Attributes:
      eqn_layers: per equation, its layer in 0..num_layers-1, or -1 for a
        boundary marker (dropped when the layers are marked).
      num_layers: number of (non-empty) layers.
    """

    eqn_layers: tuple[int, ...]
    num_layers: int


def construct_layers(forward: ClosedJaxpr, option: LayerOption) -> LayerAssignment:
    """Assigns the equations of `forward` to layers as `option` says.

    Raises:
      ValueError: manual layers but no `mark_pipeline_boundary()` in the
        loss, or more automatic layers than operations.
    """
    if isinstance(option, ManualLayerOption):
        return _manual_layers(forward)
    if isinstance(option, AutoLayerOption):
        return _auto_layers(forward, option)
    raise TypeError(f"Unknown layer option {option!r}.")


def _manual_layers(forward: ClosedJaxpr) -> LayerAssignment:
    eqns = forward.jaxpr.eqns
    if not any(is_marker(e, MarkerKind.BOUNDARY) for e in eqns):
        raise ValueError(
            "layer_option='manual' needs at least one pipeshard.mark_pipeline_boundary() call "
            "in the loss function to cut it into layers; add markers between layers or use "
            "layer_option=AutoLayerOption(layer_num=...)."
        )
    layers, current, current_used = [], 0, False
    for eqn in eqns:
        if is_marker(eqn, MarkerKind.BOUNDARY):
            layers.append(-1)
            # A boundary with nothing before it (or two in a row) opens no layer.
            if current_used:
                current, current_used = current + 1, False
        else:
            layers.append(current)
            current_used = True
    num_layers = current + 1 if current_used else current
    if num_layers < 1:
        raise ValueError("The loss function has no operations to cut into layers.")
    return LayerAssignment(eqn_layers=tuple(layers), num_layers=num_layers)


def _auto_layers(forward: ClosedJaxpr, option: AutoLayerOption) -> LayerAssignment:
    eqns = forward.jaxpr.eqns
    compute = [i for i, e in enumerate(eqns) if not is_marker(e, MarkerKind.BOUNDARY)]
    if len(compute) < option.layer_num:
        raise ValueError(
            f"AutoLayerOption(layer_num={option.layer_num}) asks for more layers than the "
            f"loss has operations ({len(compute)}); use at most {len(compute)} layers."
        )
    flops = np.array([eqn_flops(eqns[i]) for i in compute])
    cut_bytes = _cut_bytes(forward, compute)
    starts = _balanced_cuts(flops, cut_bytes, option.layer_num, option.flops_tolerance)
    layer_of = np.searchsorted(np.asarray(starts), np.arange(len(compute)), side="right") - 1
    layers = [-1] * len(eqns)
    for position, index in enumerate(compute):
        layers[index] = int(layer_of[position])
    logger.info(
        "Automatic layers: %s FLOPs per layer.",
        [float(flops[layer_of == k].sum()) for k in range(option.layer_num)],
    )
    return LayerAssignment(eqn_layers=tuple(layers), num_layers=option.layer_num)


def _cut_bytes(forward: ClosedJaxpr, compute: Sequence[int]) -> np.ndarray:
    """Bytes of values live across each cut point.

    `result[c]` is for the cut just before the c-th compute equation: the
    values defined by an earlier equation and read by a later one (or
    returned). Program inputs never count: they are sent to every stage that
    reads them, not carried across cuts.
    """
    position = {index: p for p, index in enumerate(compute)}
    defined_at, last_use = {}, {}
    for index, eqn in enumerate(forward.jaxpr.eqns):
        p = position.get(index)
        if p is None:
            continue
        for var in vars_of(eqn.invars):
            if var in defined_at:
                last_use[var] = p
        for var in vars_of(eqn.outvars):
            defined_at[var] = p
    for var in vars_of(forward.jaxpr.outvars):
        if var in defined_at:
            last_use[var] = len(compute)
    delta = np.zeros(len(compute) + 2)
    for var, used in last_use.items():
        # Live across cuts defined_at+1 .. used.
        delta[defined_at[var] + 1] += nbytes(var.aval)
        delta[used + 1] -= nbytes(var.aval)
    return np.cumsum(delta)[: len(compute) + 1]


def _balanced_cuts(flops: np.ndarray, cut_bytes: np.ndarray, k: int, tolerance: float) -> list:
    """Start positions of `k` contiguous segments: balanced, then fewest bytes cut."""
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    cap = (1.0 + tolerance) * _min_max_segment(flops, k) + 1e-9 * prefix[-1]
    n = len(flops)
    # cost[j][i]: fewest bytes cut putting the first i equations in j segments.
    cost = np.full((k + 1, n + 1), np.inf)
    parent = np.zeros((k + 1, n + 1), dtype=np.int64)
    cost[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            lo = int(np.searchsorted(prefix, prefix[i] - cap, side="left"))
            lo, hi = max(lo, j - 1), i - 1
            if lo > hi:
                continue
            previous = cost[j - 1][lo : hi + 1] + np.where(
                np.arange(lo, hi + 1) > 0, cut_bytes[lo : hi + 1], 0.0
            )
            best = int(np.argmin(previous))
            cost[j][i], parent[j][i] = previous[best], lo + best
    starts, i = [], n
    for j in range(k, 0, -1):
        i = int(parent[j][i])
        starts.append(i)
    return starts[::-1]


def _min_max_segment(flops: np.ndarray, k: int) -> float:
    """Smallest achievable largest-segment sum over k non-empty segments."""
    lo, hi = float(flops.max(initial=0.0)), float(flops.sum())

    def segments_needed(cap: float) -> int:
        count, running = 1, 0.0
        for f in flops:
            if running + f > cap:
                count, running = count + 1, 0.0
            running += f
        return count

    for _ in range(60):
        mid = (lo + hi) / 2
        if segments_needed(mid) <= k:
            hi = mid
        else:
            lo = mid
    return hi


def layered_function(forward: ClosedJaxpr, layers: LayerAssignment) -> Callable[..., list]:
    """`forward` as a function with each layer between START and END markers.

    Layer `l`'s START marker passes every value the layer reads from outside
    (program inputs, parameters included, and earlier layers' outputs); its
    END marker passes every value it produces for later layers or returns.
    """
    jaxpr = forward.jaxpr
    members = [[] for _ in range(layers.num_layers)]
    for eqn, layer in zip(jaxpr.eqns, layers.eqn_layers):
        if layer >= 0:
            members[layer].append(eqn)
    ins, outs = _layer_interfaces(members, jaxpr.outvars)

    def run(*args):
        env = dict(zip(jaxpr.constvars, forward.consts))
        env.update(zip(jaxpr.invars, args))
        for layer, eqns in enumerate(members):
            marked = mark_layer([env[v] for v in ins[layer]], layer=layer, kind=MarkerKind.START)
            local = dict(zip(ins[layer], marked))
            eval_eqns(eqns, local)
            results = [local[v] for v in outs[layer]]
            env.update(zip(outs[layer], mark_layer(results, layer=layer, kind=MarkerKind.END)))
        return [read_atom(env, v) for v in jaxpr.outvars]

    return run


def _layer_interfaces(members, outvars) -> tuple[list[list[Var]], list[list[Var]]]:
    """Per layer: the variables it reads from outside, and those it exports."""
    defined = [{v for e in eqns for v in vars_of(e.outvars)} for eqns in members]
    ins = []
    for layer, eqns in enumerate(members):
        used = dict.fromkeys(v for e in eqns for v in vars_of(e.invars))
        ins.append([v for v in used if v not in defined[layer]])
    needed_later: set[Var] = set(vars_of(outvars))
    outs = [[] for _ in members]
    for layer in reversed(range(len(members))):
        outs[layer] = [v for v in _ordered(defined[layer], members[layer]) if v in needed_later]
        needed_later |= set(ins[layer])
    return ins, outs


def _ordered(variables: set[Var], eqns) -> list[Var]:
    return [v for e in eqns for v in vars_of(e.outvars) if v in variables]
