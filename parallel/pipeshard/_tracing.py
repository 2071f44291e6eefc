"""Tracing the train step and differentiating its layer-marked loss.

The train step is traced twice, as Alpa does: at the full batch, for the
program around the gradient (the update), and at the microbatch size, for
the loss the pipeline runs once per microbatch (shapes in the loss, such as
a mean's divisor, follow the batch size).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxprs_in_params

from parallel.pipeshard._apply import StepGraph
from parallel.pipeshard._grad import capturing_gradients, pipeline_grad_p
from parallel.pipeshard._jaxprs import eqn_contains_marker, inline_marked_calls, vars_of
from parallel.pipeshard._layers import LayerAssignment, construct_layers, layered_function
from parallel.pipeshard._options import LayerOption


@dataclasses.dataclass(frozen=True, kw_only=True)
class TracedStep:
    """A train step traced around its pipelined gradient.

    Attributes:
      step: the train step at full batch shapes.
      loss_jaxpr: the loss at microbatch shapes; its constvars follow its
        invars as inputs of the gradient equation.
      num_diff: how many leading loss inputs are differentiated.
      loss_in_avals: the loss inputs (invars, then constvars), microbatch.
      split_inputs: per loss input, whether it is sliced into microbatches.
      concat_outputs: per output `[loss, *grads]`, whether it is
        concatenated over microbatches (gradients of sliced inputs).
      out_tree: structure of the train step's result.
    """

    step: StepGraph
    loss_jaxpr: Jaxpr
    num_diff: int
    loss_in_avals: tuple[jax.ShapeDtypeStruct, ...]
    split_inputs: tuple[bool, ...]
    concat_outputs: tuple[bool, ...]
    out_tree: Any


def abstract_leaf(leaf: Any) -> jax.ShapeDtypeStruct:
    aval = jax.typeof(leaf)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def trace_step(
    fun: Callable, args: tuple, batch_argnums: Sequence[int], num_microbatches: int
) -> TracedStep:
    """Traces `fun(*args)` at the full and the microbatch batch size.

    Raises:
      ValueError: a batch leaf whose leading size the microbatches do not
        divide, or a train step of an unsupported form (see `_graph`).
    """
    flat, in_tree = jax.tree.flatten(args)
    split_leaves = _split_leaves(args, batch_argnums, num_microbatches)
    full = [abstract_leaf(x) for x in flat]
    micro = [
        jax.ShapeDtypeStruct((a.shape[0] // num_microbatches, *a.shape[1:]), a.dtype)
        if i in split_leaves
        else a
        for i, a in enumerate(full)
    ]

    def flat_fun(*leaves):
        return fun(*jax.tree.unflatten(in_tree, leaves))

    with capturing_gradients():
        full_jaxpr, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*full)
        micro_jaxpr = jax.make_jaxpr(flat_fun)(*micro)
    full_index = _grad_eqn_index(full_jaxpr)
    micro_index = _grad_eqn_index(micro_jaxpr)
    sources = _grad_sources(full_jaxpr, full_index)
    _check_same_sources(sources, _grad_sources(micro_jaxpr, micro_index), full_jaxpr, micro_jaxpr)
    _check_update(full_jaxpr, full_index, split_leaves)
    eqn = micro_jaxpr.jaxpr.eqns[micro_index]
    split = tuple(_is_split(full_jaxpr, s, split_leaves) for s in sources)
    num_diff = eqn.params["num_diff"]
    return TracedStep(
        step=StepGraph(jaxpr=full_jaxpr, grad_index=full_index, grad_sources=sources),
        loss_jaxpr=eqn.params["jaxpr"],
        num_diff=num_diff,
        loss_in_avals=tuple(
            jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
            for v in eqn.invars
        ),
        split_inputs=split,
        concat_outputs=(False, *split[:num_diff]),
        out_tree=jax.tree.structure(out_shape),
    )


def _split_leaves(args: tuple, batch_argnums: Sequence[int], m: int) -> set[int]:
    """Flat indices of the leaves of the batch arguments, checked against m."""
    split, offset = set(), 0
    for position, arg in enumerate(args):
        leaves = jax.tree_util.tree_flatten_with_path(arg)[0]
        if position in batch_argnums:
            for i, (path, leaf) in enumerate(leaves):
                shape = np.shape(leaf)
                if not shape or shape[0] % m:
                    raise ValueError(
                        f"Batch leaf args[{position}]{jax.tree_util.keystr(path)} has shape "
                        f"{shape}: num_micro_batches={m} must divide its leading (batch) "
                        f"dimension. Use a batch size divisible by {m} or another "
                        "num_micro_batches."
                    )
                split.add(offset + i)
        offset += len(leaves)
    return split


def _grad_eqn_index(closed: ClosedJaxpr) -> int:
    eqns = closed.jaxpr.eqns
    top = [i for i, e in enumerate(eqns) if e.primitive is pipeline_grad_p]
    if len(top) == 1:
        return top[0]
    if len(top) > 1:
        raise ValueError(
            f"The train step takes {len(top)} pipelined gradients; call "
            "pipeshard.value_and_grad (or grad) exactly once per step."
        )
    if any(_contains_grad(sub) for e in eqns for sub in jaxprs_in_params(e.params)):
        raise ValueError(
            "pipeshard.value_and_grad is called inside jax.jit, vmap, a control-flow "
            "primitive or a custom-derivative function of the train step; call it directly "
            "in the function given to parallelize."
        )
    raise ValueError(
        "The train step given to parallelize never calls pipeshard.value_and_grad or "
        "pipeshard.grad; take the gradient of the loss with one of them."
    )


def _contains_grad(jaxpr: Jaxpr) -> bool:
    return any(
        e.primitive is pipeline_grad_p or any(_contains_grad(s) for s in jaxprs_in_params(e.params))
        for e in jaxpr.eqns
    )


def _grad_sources(closed: ClosedJaxpr, index: int) -> tuple[Any, ...]:
    """The train step's atoms the gradient equation reads: inputs, consts or literals."""
    jaxpr = closed.jaxpr
    allowed = set(jaxpr.invars) | set(jaxpr.constvars)
    for atom in jaxpr.eqns[index].invars:
        if not isinstance(atom, Literal) and atom not in allowed:
            producer = next(e for e in jaxpr.eqns if atom in e.outvars)
            raise ValueError(
                f"The train step computes `{producer.primitive.name}` before "
                "pipeshard.value_and_grad and passes the result to the loss; only the train "
                "step's own arguments (and constants) may reach the loss. Move that "
                "computation inside the loss function."
            )
    return tuple(jaxpr.eqns[index].invars)


def _source_key(closed: ClosedJaxpr, atom) -> tuple:
    jaxpr = closed.jaxpr
    if isinstance(atom, Literal):
        return ("literal", repr(atom.val))
    if atom in jaxpr.invars:
        return ("arg", jaxpr.invars.index(atom))
    const = closed.consts[jaxpr.constvars.index(atom)]
    return ("const", np.shape(const))


def _check_same_sources(full_sources, micro_sources, full_jaxpr, micro_jaxpr) -> None:
    full_keys = [_source_key(full_jaxpr, a) for a in full_sources]
    micro_keys = [_source_key(micro_jaxpr, a) for a in micro_sources]
    if full_keys != micro_keys:
        raise ValueError(
            "The loss reads different values when the train step is traced at the "
            "microbatch size (for example a constant whose shape follows the batch size); "
            "pass such values in the batch argument instead."
        )


def _check_update(closed: ClosedJaxpr, grad_index: int, split_leaves: set[int]) -> None:
    """Rejects markers outside the loss and updates that read the batch."""
    jaxpr = closed.jaxpr
    batch_vars = {v for i, v in enumerate(jaxpr.invars) if i in split_leaves}
    for i, eqn in enumerate(jaxpr.eqns):
        if i == grad_index:
            continue
        if eqn_contains_marker(eqn):
            raise ValueError(
                "mark_pipeline_boundary() is called in the train step outside the loss "
                "function; markers belong inside the function given to "
                "pipeshard.value_and_grad."
            )
        read = batch_vars.intersection(vars_of(eqn.invars))
        if read:
            raise ValueError(
                f"The train step reads its batch argument in `{eqn.primitive.name}` outside "
                "the loss function; only the loss may read the batch (return metrics from "
                "the loss or compute them in a separate function)."
            )


def _is_split(closed: ClosedJaxpr, atom, split_leaves: set[int]) -> bool:
    invars = closed.jaxpr.invars
    return not isinstance(atom, Literal) and atom in invars and invars.index(atom) in split_leaves


def differentiate(traced: TracedStep, option: LayerOption) -> tuple[ClosedJaxpr, LayerAssignment]:
    """The layer-marked `value_and_grad` of the loss, and its layers.

    Returns:
      The program `(*loss_inputs) -> [loss, *grads]` at microbatch shapes,
      with forward and backward layers between markers, and the layers.
    """
    forward = inline_marked_calls(traced.loss_jaxpr, traced.loss_in_avals)
    layers = construct_layers(forward, option)
    layered = layered_function(forward, layers)
    num_diff = traced.num_diff

    def value_and_grads(*flat):
        def loss(diff):
            return layered(*diff, *flat[num_diff:])[0]

        value, grads = jax.value_and_grad(loss)(list(flat[:num_diff]))
        return [value, *grads]

    return jax.make_jaxpr(value_and_grads)(*traced.loss_in_avals), layers
