"""Reading one device's layout and routing its rows (inside `shard_map`).

Per slot and minibatch, the layout's entries (docs/design.md section 2) are
sorted by partition and local id, so the distinct rows each owner device
must send come out of one pass: `route` (XLA) or `_cpu_kernels.route`. Both
paths share the phases of a minibatch, for the lookup and for the update:
plan (route), exchange the requested rows, gather the owned rows, exchange
them back, pool per sample (or, backwards, sum per distinct row). The
exchanges of all stacked tables travel in one all-to-all (`exchange_group`):
each collective is a rendezvous of every device, and on CPU, devices that
share cores pay for each one.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from embedding import _cpu_kernels
from embedding._layout import ALIGNMENT
from embedding._stack_geometry import LayoutArrays, StackGeometry


class Entries(NamedTuple):
    """One device's layout entries, decoded once for all minibatches.

    Attributes:
      segment: `int32[S, C]` the entry's `minibatch * N + partition`; -1 for
        padding.
      valid: `bool[S, C]` false for padding.
      ids: `int32[S, C]` local ids within the partition.
      samples: `int32[S, C]` samples in the slot; `P` for padding.
      gains: `float32[S, C]`; 0 for padding.
    """

    segment: jax.Array
    valid: jax.Array
    ids: jax.Array
    samples: jax.Array
    gains: jax.Array


class Routing(NamedTuple):
    """Where one minibatch's entries of one device go (inside `shard_map`).

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
        samples=jnp.where(valid, layout.sample_ids.reshape(s, c), g.samples),
        gains=jnp.where(valid, layout.gains.reshape(s, c), 0.0),
    )


def route(entries: Entries, g: StackGeometry, minibatch: Any) -> Routing:
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


def over_minibatches(g: StackGeometry, num_minibatches: jax.Array, body, init):
    """`body(k, carry)` for k in 0..num_minibatches-1; a single call without
    minibatching (which keeps the lookup differentiable in reverse mode)."""
    if g.minibatches == 1:
        return body(0, init)
    return jax.lax.fori_loop(0, num_minibatches[0], body, init)


def exchange(x: jax.Array, axis: str) -> jax.Array:
    """All-to-all over dim 1: `[S, G, ...]`, block `[:, h]` goes to device h,
    and block `[:, h]` of the result came from device h."""
    return jax.lax.all_to_all(x, axis, 1, 1, tiled=True)


def exchange_group(arrays: list[jax.Array], axis: str) -> list[jax.Array]:
    """`exchange` of several `[S, G, ...]` arrays of one dtype in one all-to-all."""
    if len(arrays) == 1:
        return [exchange(arrays[0], axis)]
    s, g = arrays[0].shape[:2]
    flat = [x.reshape(s, g, -1) for x in arrays]
    sizes = [x.shape[2] for x in flat]
    exchanged = exchange(jnp.concatenate(flat, axis=2), axis)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [
        exchanged[:, :, start : start + size].reshape(x.shape)
        for x, start, size in zip(arrays, starts, sizes)
    ]


class MinibatchPlan(NamedTuple):
    """One stack's routing of one minibatch, on either path.

    Attributes:
      send_rows: `int32[S, G, U]` (see `Routing`).
      routing: the XLA path's `Routing`, or the kernels' `int32[S, C]`
        entry index into `[S, G, U]`.
    """

    send_rows: jax.Array
    routing: Any


class StackInput(NamedTuple):
    """One stack's layout on one device, read once for all minibatches.

    Attributes:
      layout: this device's layout arrays.
      entries: the decoded entries (XLA path), or None (kernels).
      segment: `int32[S, C]` the entries' segments.
    """

    layout: LayoutArrays
    entries: Entries | None
    segment: jax.Array


def read_layout(
    layout: LayoutArrays, g: StackGeometry, kernels: bool, segment: jax.Array | None = None
) -> StackInput:
    """Reads one device's layout: its segments (unless given) and, on the XLA
    path, its decoded entries."""
    if kernels:
        if segment is None:
            segment = _cpu_kernels.segments(layout.row_pointers, layout.embedding_ids, g)
        return StackInput(layout, None, segment)
    segment = find_segments(layout, g) if segment is None else segment
    return StackInput(layout, decode(layout, g, segment), segment)


def plan_minibatch(stack: StackInput, g: StackGeometry, minibatch: Any) -> MinibatchPlan:
    """Routes the minibatch's entries of one stack."""
    if stack.entries is None:
        layout = stack.layout
        return MinibatchPlan(
            *_cpu_kernels.route(layout.row_pointers, layout.embedding_ids, minibatch, g)
        )
    routing = route(stack.entries, g, minibatch)
    return MinibatchPlan(routing.send_rows, routing)


def gather_owned(table: jax.Array, owned: jax.Array, g: StackGeometry, kernels: bool) -> jax.Array:
    """`float32[S, G, U, D]`: the owner's rows `owned` (`int32[S, G, U]`),
    zero where unused."""
    if kernels:
        return _cpu_kernels.gather_rows(table, owned)
    return table.at[owned].get(mode="fill", fill_value=0)


def pool(stack: StackInput, plan: MinibatchPlan, rows: jax.Array, g: StackGeometry) -> jax.Array:
    """`float32[S, P, D]`: the minibatch's rows (`float32[S, G, U, D]`, as
    received from their owners), scaled by gain and summed per sample."""
    if stack.entries is None:
        layout = stack.layout
        return _cpu_kernels.pool(plan.routing, layout.sample_ids, layout.gains, rows, g.samples)
    entries, routing = stack.entries, plan.routing
    slot = _slot_index(g)
    per_entry = rows.at[slot, routing.dest, routing.unique].get(mode="fill", fill_value=0)
    combined = jnp.zeros((g.slots, g.samples, g.dim), rows.dtype)
    return combined.at[slot, entries.samples].add(per_entry * entries.gains[..., None], mode="drop")


def row_gradients(
    stack: StackInput, plan: MinibatchPlan, sample_grads: jax.Array, g: StackGeometry
) -> jax.Array:
    """`float32[S, G, U, D]`: the transpose of `pool`, per distinct row the
    sum of gain times its samples' gradients (`float32[S, P, D]`)."""
    if stack.entries is None:
        layout = stack.layout
        return _cpu_kernels.pool_transpose(
            plan.routing,
            layout.sample_ids,
            layout.gains,
            sample_grads,
            (g.slots, g.devices, g.uniques, g.dim),
        )
    entries, routing = stack.entries, plan.routing
    slot = _slot_index(g)
    entry_grads = sample_grads.at[slot, entries.samples].get(mode="fill", fill_value=0)
    entry_grads = entry_grads * entries.gains[..., None]
    unique_grads = jnp.zeros((g.slots, g.devices, g.uniques, g.dim), jnp.float32)
    return unique_grads.at[slot, routing.dest, routing.unique].add(entry_grads, mode="drop")
