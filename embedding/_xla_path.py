"""The lookup's path in XLA ops (`_routing.LookupPath`), `XLA_PATH`.

The path of every platform but CPU with its kernels, and the reference the
tests hold the kernels to. A device decodes its layout once (`Entries`),
numbers each minibatch's distinct rows per owner with prefix counts
(`Routing`), and gathers, pools and scatters with XLA's gather and scatter.
The owner merges a row's gradients through an `int32` buffer of the shard's
rows (`merge_duplicate_rows`) and applies `_optimizer_updates` to the
representatives (`apply_update`, also the kernel path's for the optimizers
without a kernel).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from embedding._feature_blocks import pooled_positions
from embedding._layout import ALIGNMENT
from embedding._optimizer_updates import apply_optimizer
from embedding._variables import EmbeddingVariables

if TYPE_CHECKING:
    # Annotations only: `_routing` picks the path, so it imports this.
    from embedding._routing import OwnerUpdate
    from embedding._stack_geometry import LayoutArrays, StackGeometry


class Entries(NamedTuple):
    """One device's layout entries, decoded once for all minibatches (the
    path's stack input).

    Attributes:
      segment: `int32[S, C]` the entry's `minibatch * N + partition`; -1 for
        padding.
      valid: `bool[S, C]` false for padding.
      ids: `int32[S, C]` local ids within the partition.
      samples: `int32[S, C]` samples' `pooled_positions` in the slot; `P`
        for padding.
      gains: `float32[S, C]`; 0 for padding.
    """

    segment: jax.Array
    valid: jax.Array
    ids: jax.Array
    samples: jax.Array
    gains: jax.Array


class Routing(NamedTuple):
    """Where one minibatch's entries of one device go (the path's plan).

    Attributes:
      dest: `int32[S, C]` device owning each entry's row.
      unique: `int32[S, C]` index of the entry's row among the distinct rows
        the slot needs from `dest`; `U` for entries outside the minibatch.
      send_rows: `int32[S, G, U]` row in the owner's shard of every distinct
        row; `S * R` (out of range) where unused.
    """

    dest: jax.Array
    unique: jax.Array
    send_rows: jax.Array


def _round_up_to_alignment(x: jax.Array) -> jax.Array:
    return (x + (ALIGNMENT - 1)) // ALIGNMENT * ALIGNMENT


_PREFIX_BLOCK = 64


def running_count(x: jax.Array) -> jax.Array:
    """Inclusive cumulative sum along the last axis of small counts `int[S, C]`.

    XLA:CPU runs `jnp.cumsum` as a log-depth scan of many small ops; two
    triangular matmuls (within blocks of 64, then over the block totals) are
    several times faster. Float32 at full precision is exact below 2**24.
    """
    s, c = x.shape
    blocks = -(-c // _PREFIX_BLOCK)
    padded = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, blocks * _PREFIX_BLOCK - c)))
    padded = padded.reshape(s, blocks, _PREFIX_BLOCK)
    highest = jax.lax.Precision.HIGHEST
    within = jnp.matmul(
        padded, jnp.triu(jnp.ones((_PREFIX_BLOCK, _PREFIX_BLOCK), jnp.float32)), precision=highest
    )
    before = jnp.matmul(
        within[:, :, -1], jnp.triu(jnp.ones((blocks, blocks), jnp.float32), 1), precision=highest
    )
    total = within + before[:, :, None]
    return total.reshape(s, -1)[:, :c].astype(jnp.int32)


def _slot_index(g: StackGeometry) -> jax.Array:
    """`int32[S, 1]`, to index `[S, ...]` buffers entry by entry."""
    return jnp.arange(g.slots, dtype=jnp.int32)[:, None]


def find_segments(layout: LayoutArrays, g: StackGeometry) -> jax.Array:
    """`int32[S, C]`: each entry's `minibatch * N + partition` in one device's
    layout, -1 for padding.

    Args:
      layout: this device's arrays: row pointers `int32[S * K * W]`, ids,
        samples and gains `[S * C]`.
      g: the stack's geometry.
    """
    s, n, c = g.slots, g.partitions, g.capacity
    pointers = layout.row_pointers.reshape(s, g.minibatches, g.row_pointer_width)
    ends = pointers[:, :, :n].reshape(s, g.minibatches * n)
    slot = _slot_index(g)
    # A segment starts where the one before it ends, rounded up to 8; counting
    # the starts at or before each position gives the position's segment.
    starts = _round_up_to_alignment(ends[:, :-1])
    marks = jnp.zeros((s, c + 1), jnp.int32).at[slot, starts].add(1)
    segment = running_count(marks)[:, :c]
    valid = jnp.arange(c) < jnp.take_along_axis(ends, segment, axis=1)
    return jnp.where(valid, segment, -1)


def decode(layout: LayoutArrays, g: StackGeometry, segment: jax.Array | None = None) -> Entries:
    """Every entry of one device's layout with its segment.

    Args:
      layout: this device's arrays (see `find_segments`).
      g: the stack's geometry.
      segment: `find_segments(layout, g)` if already known.
    """
    s, c = g.slots, g.capacity
    segment = find_segments(layout, g) if segment is None else segment
    valid = segment >= 0
    return Entries(
        segment=segment,
        valid=valid,
        ids=layout.embedding_ids.reshape(s, c),
        samples=jnp.where(valid, pooled_positions(layout.sample_ids.reshape(s, c), g), g.samples),
        gains=jnp.where(valid, layout.gains.reshape(s, c), 0.0),
    )


def route(entries: Entries, g: StackGeometry, minibatch: int | jax.Array) -> Routing:
    """Finds each entry's owner and distinct-row index within `minibatch`.

    Entries of one row are adjacent in a segment and segments of one owner
    follow each other, so a cumulative sum numbers the distinct rows.
    """
    s = g.slots
    slot = _slot_index(g)
    partition = entries.segment % g.partitions
    valid = entries.valid
    if g.minibatches > 1:
        valid = valid & (entries.segment // g.partitions == minibatch)
    row = jnp.where(valid, partition * g.rows + entries.ids, -1)
    previous = jnp.pad(row[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    first = valid & (row != previous)
    dest = partition // s
    rank = running_count(first) - 1
    per_dest = jnp.zeros((s, g.devices), jnp.int32).at[slot, dest].add(first.astype(jnp.int32))
    before = jnp.cumsum(per_dest, axis=1) - per_dest
    unique = jnp.where(valid, rank - jnp.take_along_axis(before, dest, axis=1), g.uniques)
    send_rows = jnp.full((s, g.devices, g.uniques), g.shard_rows, jnp.int32)
    send_rows = send_rows.at[slot, dest, jnp.where(first, unique, g.uniques)].set(
        row - dest * g.shard_rows, mode="drop"
    )
    return Routing(dest=dest, unique=unique, send_rows=send_rows)


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


@dataclasses.dataclass(frozen=True)
class XlaPath:
    """`_routing.LookupPath` in XLA ops: stack input `Entries`, plan `Routing`.

    Stateless; use the singleton `XLA_PATH`.
    """

    def read_layout(
        self, layout: LayoutArrays, g: StackGeometry, segment: jax.Array | None = None
    ) -> Entries:
        return decode(layout, g, segment)

    def plan_minibatch(
        self, stack: Entries, g: StackGeometry, minibatch: int | jax.Array
    ) -> Routing:
        return route(stack, g, minibatch)

    def gather_owned(self, table: jax.Array, owned: jax.Array) -> jax.Array:
        return table.at[owned].get(mode="fill", fill_value=0)

    def pool(self, stack: Entries, plan: Routing, rows: jax.Array, g: StackGeometry) -> jax.Array:
        slot = _slot_index(g)
        per_entry = rows.at[slot, plan.dest, plan.unique].get(mode="fill", fill_value=0)
        combined = jnp.zeros((g.slots, g.samples, g.dim), rows.dtype)
        return combined.at[slot, stack.samples].add(per_entry * stack.gains[..., None], mode="drop")

    def row_gradients(
        self, stack: Entries, plan: Routing, sample_grads: jax.Array, g: StackGeometry
    ) -> jax.Array:
        slot = _slot_index(g)
        entry_grads = sample_grads.at[slot, stack.samples].get(mode="fill", fill_value=0)
        entry_grads = entry_grads * stack.gains[..., None]
        unique_grads = jnp.zeros((g.slots, g.devices, g.uniques, g.dim), jnp.float32)
        return unique_grads.at[slot, plan.dest, plan.unique].add(entry_grads, mode="drop")

    def apply_update(self, update: OwnerUpdate, g: StackGeometry) -> EmbeddingVariables:
        # A scatter-min of positions names one representative per row; only
        # the representatives' rows and slots are gathered, updated and
        # scattered back, into the buffers the gathers read (in place).
        variables = update.variables
        rows, received = update.rows.reshape(-1), update.grads.reshape(-1, g.dim)
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
            learning_rate=update.learning_rate,
            step=update.step,
            row_dims=g.row_dims(target),
        )
        return EmbeddingVariables(
            variables.table.at[target].set(new_rows, mode="drop"),
            jax.tree.map(
                lambda values, new: values.at[target].set(new, mode="drop"),
                variables.slots,
                new_slots,
            ),
        )


XLA_PATH = XlaPath()
