"""The sharded backward pass and optimizer update, `apply_gradients`.

Per stacked table, inside `jax.shard_map`, every device:
1. routes its layout as the forward does (`_lookup.route`);
2. turns the activation gradients into one gradient per entry (gain times
   the sample's gradient) and sums them per distinct row of each slot;
3. sends each owner its rows' gradients (all-to-all, the forward's path in
   reverse);
4. as owner, merges the gradients one row got from several slots and devices:
   a scatter-min of positions into an `int32` buffer of the shard's rows
   names one representative per row, and the gradients are summed into it;
5. gathers the representatives' rows and slots, applies the optimizer
   (`_optimizer_updates`) and scatters them back. Only rows with an entry in
   the batch are written; every other row and slot keeps its bits.

A minibatched input repeats 1-5 per minibatch, in order.

The tables and slots are donated, so the update happens in place: the
scatters write into the buffers the gathers read, ordered by the data
dependency between them, and the compiled program holds no copy of a table.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from embedding._lookup import (
    Entries,
    LayoutArrays,
    LayoutIndex,
    StackGeometry,
    decode,
    exchange,
    over_minibatches,
    prepare_call,
    route,
)
from embedding._optimizer_updates import apply_optimizer
from embedding._preprocess import PreprocessedInput
from embedding._stacking import Nested
from embedding._variables import EmbeddingVariables, mesh_axis


def merge_duplicate_rows(
    rows: jax.Array, grads: jax.Array, num_rows: int
) -> tuple[jax.Array, jax.Array]:
    """Sums the gradients of equal rows into the row's first occurrence.

    Args:
      rows: `int32[M]` shard rows; `num_rows` marks an unused position.
      grads: `float32[M, D]`.
      num_rows: rows of the shard.

    Returns:
      `(first: bool[M], merged: float32[M, D])`: `first` marks the first
      occurrence of every used row, `merged` holds the row's summed gradient
      there.
    """
    positions = jnp.arange(rows.shape[0], dtype=jnp.int32)
    first_position = jnp.full((num_rows,), rows.shape[0], jnp.int32)
    first_position = first_position.at[rows].min(positions, mode="drop")
    representative = first_position.at[rows].get(mode="fill", fill_value=rows.shape[0])
    merged = jnp.zeros_like(grads).at[representative].add(grads, mode="drop")
    return representative == positions, merged


def _entry_gradients(grads: tuple[jax.Array, ...], entries: Entries, g: StackGeometry) -> jax.Array:
    """`float32[S, C, D]`: gain times the sample's gradient, for every entry."""
    blocks = [
        jnp.pad(
            grad.astype(jnp.float32).reshape(g.slots, f.samples_per_slot, f.dim),
            ((0, 0), (0, 0), (0, g.dim - f.dim)),
        )
        for grad, f in zip(grads, g.features, strict=True)
    ]
    sample_grads = jnp.concatenate(blocks, axis=1)
    slot = jnp.arange(g.slots, dtype=jnp.int32)[:, None]
    entry_grads = sample_grads.at[slot, entries.samples].get(mode="fill", fill_value=0)
    return entry_grads * entries.gains[..., None]


def _update_minibatch(
    entries: Entries,
    entry_grads: jax.Array,
    variables: EmbeddingVariables,
    learning_rate: jax.Array,
    step: jax.Array,
    g: StackGeometry,
    axis: str,
    minibatch: Any,
) -> EmbeddingVariables:
    routing = route(entries, g, minibatch)
    slot = jnp.arange(g.slots, dtype=jnp.int32)[:, None]
    unique_grads = jnp.zeros((g.slots, g.devices, g.uniques, g.dim), jnp.float32)
    unique_grads = unique_grads.at[slot, routing.dest, routing.unique].add(entry_grads, mode="drop")
    rows = exchange(routing.send_rows, axis).reshape(-1)
    received = exchange(unique_grads, axis).reshape(-1, g.dim)
    first, merged = merge_duplicate_rows(rows, received, g.shard_rows)
    target = jnp.where(first, rows, g.shard_rows)
    old_rows = variables.table.at[target].get(mode="fill", fill_value=0)
    old_slots = jax.tree.map(
        lambda values: values.at[target].get(mode="fill", fill_value=0), variables.slots
    )
    new_rows, new_slots = apply_optimizer(
        g.optimizer,
        old_rows,
        old_slots,
        merged,
        learning_rate=learning_rate,
        step=step,
        row_dims=g.row_dims(target),
    )
    return EmbeddingVariables(
        variables.table.at[target].set(new_rows, mode="drop"),
        jax.tree.map(
            lambda values, new: values.at[target].set(new, mode="drop"), variables.slots, new_slots
        ),
    )


def update_stack(
    layout: LayoutArrays,
    grads: tuple[jax.Array, ...],
    variables: EmbeddingVariables,
    learning_rate: jax.Array,
    step: jax.Array,
    segment: jax.Array | None,
    *,
    geometry: StackGeometry,
    axis: str,
) -> EmbeddingVariables:
    """One device's part of one stack's update (inside `shard_map`).

    Args:
      layout: this device's layout arrays.
      grads: per feature of the stack, `float32[S * samples_per_slot, dim]`.
      variables: this device's shards, `float32[S * R, D]` each.
      learning_rate: scalar.
      step: scalar int32.
      segment: the layout's `int32[S, C]` segments from the forward
        (`find_segments`), or None to find them here.
      geometry: the stack's geometry.
      axis: the mesh axis.

    Returns:
      The updated shards.
    """
    g = geometry
    entries = decode(layout, g, segment)
    entry_grads = _entry_gradients(grads, entries, g)
    return over_minibatches(
        g,
        layout.num_minibatches,
        lambda k, current: _update_minibatch(
            entries, entry_grads, current, learning_rate, step, g, axis, k
        ),
        variables,
    )


@functools.partial(jax.jit, static_argnames=("geometries", "mesh"), donate_argnames=("variables",))
def _apply(
    grads,
    layout,
    variables,
    step,
    index: LayoutIndex | None,
    *,
    geometries: tuple[StackGeometry, ...],
    mesh: Mesh,
):
    axis = mesh_axis(mesh)
    spec, replicated = PartitionSpec(axis), PartitionSpec()
    step = jnp.asarray(step, jnp.int32)
    updated, start = {}, 0
    for g in geometries:
        learning_rate = jnp.asarray(g.optimizer.get_learning_rate(step), jnp.float32)
        segment = None if index is None else index.segments[:, start : start + g.capacity]
        start += g.capacity
        update = jax.shard_map(
            functools.partial(update_stack, geometry=g, axis=axis),
            mesh=mesh,
            in_specs=(spec, spec, spec, replicated, replicated, spec),
            out_specs=spec,
        )
        updated[g.name] = update(
            layout[g.name],
            tuple(grads[f.index] for f in g.features),
            variables[g.name],
            learning_rate,
            step,
            segment,
        )
    return updated


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
    row is updated once by its table's optimizer (SGD, Adagrad, row-wise Adagrad, Adam, FTRL)
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
    )
