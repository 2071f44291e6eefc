"""The sharded backward pass and optimizer update, `apply_gradients`.

Inside `jax.shard_map`, every device, for all stacked tables at once:
1. routes its layout as the forward does, on the forward's path
   (`_routing.LookupPath`);
2. sums the activation gradients per distinct row of each slot (gain times
   the gradient of each of the row's samples);
3. sends each owner its rows and their gradients (the forward's path in
   reverse, one grouped all-to-all for the rows and one for the gradients);
4. as owner, merges the gradients one row got from several slots and
   devices and applies the optimizer once per row (`LookupPath.apply_update`).
   On CPU a kernel merges the sorted runs it received and updates SGD,
   Adagrad and row-wise Adagrad rows in place (`_kernel_path`); otherwise a
   scatter-min of positions into an `int32` buffer of the shard's rows names
   one representative per row, the gradients are summed into it, and the
   representatives' rows and slots are gathered, updated
   (`_optimizer_updates`) and scattered back (`_xla_path`).
   Only rows with an entry in the batch are written; every other row and
   slot keeps its bits.

A minibatched input repeats 1-4 per minibatch, in order.

The tables and slots are donated, so the update happens in place: the
kernel's outputs alias its inputs, the scatters write into the buffers the
gathers read, and the compiled program holds no copy of a table.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from embedding._feature_blocks import sample_gradients
from embedding._preprocess import PreprocessedInput
from embedding._routing import (
    LookupPath,
    OwnerUpdate,
    PlanT,
    StackT,
    exchange_group,
    over_minibatches,
)
from embedding._stack_geometry import LayoutArrays, LayoutIndex, StackGeometry, prepare_call
from embedding._stacking import Nested
from embedding._variables import EmbeddingVariables, mesh_axis


def update_stacks(
    layouts: tuple[LayoutArrays, ...],
    grads: tuple[tuple[jax.Array, ...], ...],
    variables: tuple[EmbeddingVariables, ...],
    learning_rates: tuple[jax.Array, ...],
    step: jax.Array,
    segments: jax.Array | None,
    *,
    geometries: tuple[StackGeometry, ...],
    axis: str,
    path: LookupPath[StackT, PlanT],
) -> tuple[EmbeddingVariables, ...]:
    """One device's part of the update of every stack (inside `shard_map`).

    Args:
      layouts: per stack, this device's layout arrays.
      grads: per stack, per feature, `float32[S * samples_per_slot, dim]`.
      variables: per stack, this device's shards, `float32[S * R, D]` each.
      learning_rates: per stack, a scalar.
      step: scalar int32.
      segments: the layout's segments from the forward, `int32[S, sum of C]`
        (`LayoutIndex`), or None to find them here.
      geometries: the stacks' geometries.
      axis: the mesh axis.
      path: the XLA path or the CPU kernels (`_routing.select_path`).

    Returns:
      The updated shards, per stack.
    """
    stacks, start = [], 0
    for layout, g in zip(layouts, geometries):
        segment = None if segments is None else segments[:, start : start + g.capacity]
        start += g.capacity
        stacks.append(path.read_layout(layout, g, segment))
    sample_grads = [sample_gradients(stack_grads, g) for stack_grads, g in zip(grads, geometries)]

    def update_minibatch(k, current):
        plans = [path.plan_minibatch(stack, g, k) for stack, g in zip(stacks, geometries)]
        rows = exchange_group([p.send_rows for p in plans], axis)
        received = exchange_group(
            [
                path.row_gradients(stack, p, sample, g)
                for stack, p, sample, g in zip(stacks, plans, sample_grads, geometries)
            ],
            axis,
        )
        return tuple(
            path.apply_update(OwnerUpdate(owned, got, v, lr, step), g)
            for owned, got, v, lr, g in zip(rows, received, current, learning_rates, geometries)
        )

    return over_minibatches(
        geometries[0], layouts[0].num_minibatches, update_minibatch, tuple(variables)
    )


@functools.partial(
    jax.jit, static_argnames=("geometries", "mesh", "path"), donate_argnames=("variables",)
)
def _apply(
    grads,
    layout,
    variables,
    step,
    index: LayoutIndex | None,
    *,
    geometries: tuple[StackGeometry, ...],
    mesh: Mesh,
    path: LookupPath,
):
    axis = mesh_axis(mesh)
    spec, replicated = PartitionSpec(axis), PartitionSpec()
    step = jnp.asarray(step, jnp.int32)
    learning_rates = tuple(
        jnp.asarray(g.optimizer.get_learning_rate(step), jnp.float32) for g in geometries
    )
    update = jax.shard_map(
        functools.partial(update_stacks, geometries=geometries, axis=axis, path=path),
        mesh=mesh,
        in_specs=(spec, spec, spec, replicated, replicated, spec),
        out_specs=spec,
    )
    updated = update(
        tuple(layout[g.name] for g in geometries),
        tuple(tuple(grads[f.index] for f in g.features) for g in geometries),
        tuple(variables[g.name] for g in geometries),
        learning_rates,
        step,
        None if index is None else index.segments,
    )
    return {g.name: v for g, v in zip(geometries, updated)}


def _checked_index(index: Any, call) -> LayoutIndex | None:
    if index is None:
        return None
    if not isinstance(index, LayoutIndex):
        raise TypeError(
            "layout_index must be the LayoutIndex sparse_dense_matmul returns with "
            f"return_layout_index=True, got {type(index).__name__}."
        )
    first = call.geometries[0]
    expected = (first.devices * first.slots, sum(g.capacity for g in call.geometries))
    if tuple(index.segments.shape) != expected:
        raise ValueError(
            f"layout_index.segments has shape {list(index.segments.shape)}, expected "
            f"{list(expected)} (stacks {', '.join(g.name for g in call.geometries)}); pass the "
            "index the forward of this input returned."
        )
    return index


def _checked_gradients(activation_grads: Nested, call) -> list:
    try:
        grads = call.treedef.flatten_up_to(activation_grads)
    except (ValueError, TypeError) as e:
        raise ValueError(f"activation_grads does not match feature_specs' structure: {e}") from e
    for g in call.geometries:
        for f in g.features:
            shape = tuple(grads[f.index].shape)
            if shape != (f.global_batch, f.dim):
                raise ValueError(
                    f"Feature {f.name!r}: activation gradient has shape {list(shape)}, "
                    f"expected [{f.global_batch}, {f.dim}] [global_batch, embedding_dim]."
                )
    return grads


def apply_gradients(
    activation_grads: Nested,
    preprocessed_input: PreprocessedInput,
    embedding_variables: Mapping[str, EmbeddingVariables],
    feature_specs: Nested,
    mesh: Mesh,
    step: Any,
    *,
    enable_minibatching: bool = False,
    layout_index: LayoutIndex | None = None,
) -> dict[str, EmbeddingVariables]:
    """Backpropagates activation gradients into the tables and updates them.

    The gradient of a row is the sum, over all its entries in the batch, of
    gain times the activation gradient of the entry's sample; each touched
    row is updated once by its table's optimizer (`embedding/_optimizer_updates.py`)
    with the learning rate `optimizer.get_learning_rate(step)`. Rows without
    an entry in the batch keep their values and slots bit for bit.

    `embedding_variables` is donated: its buffers are updated in place and
    must not be used afterwards; use the returned variables. Jit-compatible.

    Args:
      activation_grads: the pytree of `feature_specs` with, per feature,
        `float32[global_batch, embedding_dim]` (the gradient of the loss with
        respect to `sparse_dense_matmul`'s output).
      preprocessed_input: the same input the forward pass used.
      embedding_variables: `EmbeddingVariables` by stack name.
      feature_specs: the pytree of `FeatureSpec`.
      mesh: 1-D mesh over all devices.
      step: scalar int, the training step (0 for the first update); feeds
        learning-rate schedules and Adam's bias correction.
      enable_minibatching: as passed to the preprocessing; the minibatches
        are applied one after the other.
      layout_index: what `sparse_dense_matmul(..., return_layout_index=True)`
        returned for the same input, to skip reading the layout again; None
        reads it here (the result is the same).

    Returns:
      The updated `EmbeddingVariables` by stack name.

    Raises:
      ValueError: the gradients, input, variables and specs disagree.
    """
    call = prepare_call(
        preprocessed_input, embedding_variables, feature_specs, mesh, enable_minibatching
    )
    grads = _checked_gradients(activation_grads, call)
    return _apply(
        grads,
        call.layout,
        dict(embedding_variables),
        step,
        _checked_index(layout_index, call),
        geometries=call.geometries,
        mesh=mesh,
        path=call.path,
    )
