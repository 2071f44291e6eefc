"""The sharded forward lookup, `sparse_dense_matmul`, and its routing.

Per stacked table, inside `jax.shard_map` over the 1-D mesh, every device:
1. reads its layout (DESIGN.md section 2): per slot, per partition, entries
   `(local id, sample, gain)` sorted by local id, so entries of one row are
   adjacent and the distinct rows per owner device come out of a cumulative
   sum, without sorting on the device;
2. sends each owner device the distinct rows it needs from it (all-to-all of
   `int32[S, G, U]`, `U` bounded by the stack's limits);
3. gathers the rows it owns for everyone and sends them back (all-to-all of
   `float32[S, G, U, D]`);
4. scales each entry's row by its gain and sums per sample;
5. cuts the slot's samples into the stack's features.

All buffers have static shapes from the specs' limits and the layout's buffer
size. A minibatched layout (DESIGN.md section 3) holds, per slot, the
segments of minibatch 0 (partitions 0..N-1), then of minibatch 1, and so on;
the forward routes and looks up one minibatch at a time and adds up the
activations, and the update (`_update.py`) applies the minibatches one after
the other. Each row lies in one minibatch, so both equal a single pass.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from embedding._layout import ALIGNMENT
from embedding._minibatch import NUM_BUCKETS
from embedding._optimizer_updates import check_optimizer
from embedding._optimizers import OptimizerSpec
from embedding._preprocess import PreprocessedInput, _plan
from embedding._stacking import Nested, prepare_feature_specs_for_training
from embedding._variables import EmbeddingVariables, mesh_axis, row_sharding


class FeatureSlice(NamedTuple):
    """Where one feature's samples sit in a slot of its stack.

    Attributes:
      index: the feature's position among the leaves of `feature_specs`.
      name: the feature's name.
      global_batch: its global batch.
      samples_per_slot: its samples in one slot.
      sample_offset: samples of earlier features of the stack in one slot.
      dim: its (unpadded) embedding dim.
    """

    index: int
    name: str
    global_batch: int
    samples_per_slot: int
    sample_offset: int
    dim: int


class StackGeometry(NamedTuple):
    """Static sizes of one stacked table's lookup on each device.

    Attributes:
      name: stack name.
      optimizer: the stack's optimizer spec.
      devices: G, devices of the mesh.
      slots: S, partitions per device.
      rows: R, rows per partition.
      dim: D, the padded dim.
      capacity: C, layout entries per slot (`coo_size / S`).
      minibatches: K, minibatches the row pointers have room for (1, or 64
        with minibatching).
      uniques: U, distinct rows one slot can need from one device in one
        minibatch.
      samples: P, samples per slot over the stack's features.
      features: the stack's features in slot order.
      table_dims: per table of the stack, `(row_offset_in_shard,
        embedding_dim)` in row-offset order: the first local row of the
        table in every partition and its unpadded dim.
    """

    name: str
    optimizer: OptimizerSpec
    devices: int
    slots: int
    rows: int
    dim: int
    capacity: int
    minibatches: int
    uniques: int
    samples: int
    features: tuple[FeatureSlice, ...]
    table_dims: tuple[tuple[int, int], ...]

    def row_dims(self, shard_rows: jax.Array) -> jax.Array:
        """`float32[...]`: the unpadded dim of the table each of `shard_rows`
        (`int32[...]`, rows of a device's shard) belongs to."""
        dims = [dim for _, dim in self.table_dims]
        if len(set(dims)) == 1:
            return jnp.full(shard_rows.shape, dims[0], jnp.float32)
        local = shard_rows % self.rows
        starts = jnp.asarray([start for start, _ in self.table_dims[1:]], jnp.int32)
        table = jnp.sum(local[..., None] >= starts, axis=-1)
        return jnp.asarray(dims, jnp.float32)[table]

    @property
    def partitions(self) -> int:
        return self.devices * self.slots

    @property
    def row_pointer_width(self) -> int:
        return max(self.partitions, ALIGNMENT)

    @property
    def shard_rows(self) -> int:
        """Rows of the table one device holds (`S * R`)."""
        return self.slots * self.rows


class LayoutArrays(NamedTuple):
    """One stack's layout as (global) arrays, dim 0 split over the devices.

    Attributes:
      row_pointers: `int32[G * S * K * max(N, 8)]`.
      embedding_ids: `int32[G * coo_size]`.
      sample_ids: `int32[G * coo_size]`.
      gains: `float32[G * coo_size]`.
      num_minibatches: `int32[G]`, minibatches in use (the same on every device).
    """

    row_pointers: Any
    embedding_ids: Any
    sample_ids: Any
    gains: Any
    num_minibatches: Any


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


class LayoutIndex(NamedTuple):
    """Where the lookup found each layout entry's segment, for every stack.

    Finding the segments (a scatter, a prefix count and a gather over every
    entry) is the costly part of reading a layout; the forward returns them
    so that the update of the same batch need not find them again. That
    matters when the two run in different programs or on different batches
    in one program (SC/TC pipelining), where XLA cannot share the work.

    One array for all stacks, because every array a program returns or takes
    costs a buffer per device on each call: an index handed from step to
    step (the pipeline state) would otherwise cost two per stack.

    Attributes:
      segments: `int32[G * S, sum of C over the stacks]`: per stack, in the
        order the feature specs first name the stacks, its `[G * S, C]`
        entries' `minibatch * N + partition`, or -1 for padding.
    """

    segments: jax.Array


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


@functools.lru_cache(maxsize=64)
def stack_geometries(
    leaves: tuple, devices: int, slots: int, minibatching: bool
) -> tuple[StackGeometry, ...]:
    """The geometry of every stack of prepared feature-spec leaves."""
    geometries = []
    for plan in _plan(leaves, devices, devices, slots, minibatching):
        stacked = leaves[plan.features[0].index].table_spec.stacked_table_spec
        check_optimizer(stacked.optimizer, plan.name)
        capacity = plan.geometry.coo_size // slots
        per_partition = min(stacked.max_ids_per_partition, stacked.max_unique_ids_per_partition)
        features = tuple(
            FeatureSlice(
                f.index,
                f.name,
                leaves[f.index].global_batch_size,
                f.samples_per_slot,
                f.sample_offset,
                leaves[f.index].table_spec.embedding_dim,
            )
            for f in plan.features
        )
        tables = {
            leaves[f.index].table_spec.name: leaves[f.index].table_spec for f in plan.features
        }
        table_dims = tuple(
            sorted(
                (t.setting_in_stack.row_offset_in_shard, t.embedding_dim) for t in tables.values()
            )
        )
        geometries.append(
            StackGeometry(
                name=plan.name,
                optimizer=stacked.optimizer,
                devices=devices,
                slots=slots,
                rows=plan.geometry.rows_per_partition,
                dim=stacked.stack_embedding_dim,
                capacity=capacity,
                minibatches=plan.geometry.max_minibatches,
                uniques=min(slots * per_partition, capacity),
                samples=plan.geometry.samples_per_slot,
                features=features,
                table_dims=table_dims,
            )
        )
    return tuple(geometries)


def _slots_per_device(row_pointers_size: int, devices: int, minibatches: int, stack: str) -> int:
    """Solves `G * S * K * max(G * S, 8) = size` for S (the left side grows with S)."""

    def size(slots: int) -> int:
        return devices * slots * minibatches * max(devices * slots, ALIGNMENT)

    slots = 1
    while size(slots) < row_pointers_size:
        slots *= 2
    if size(slots) != row_pointers_size:
        raise ValueError(
            f"Stack {stack!r}: row_pointers has {row_pointers_size} entries, which fits no "
            f"partition count for {devices} devices and {minibatches} minibatch(es) "
            "(expected G * S * K * max(G * S, 8)). Preprocess with global_device_count = "
            "mesh.size, and pass enable_minibatching as the preprocessing did."
        )
    return slots


def _global_array(value: Any, mesh: Mesh) -> Any:
    if isinstance(value, np.ndarray):
        # Host-local rows of this process; the layout's dim 0 follows the devices.
        return jax.make_array_from_process_local_data(row_sharding(mesh), value.reshape(-1))
    return value.reshape(-1) if value.ndim > 1 else value


def global_layout(preprocessed_input: PreprocessedInput, mesh: Mesh) -> dict[str, LayoutArrays]:
    """The layout of every stack as arrays over the mesh's devices.

    Host numpy arrays (this process's devices, as the preprocessing returns
    them) become global arrays sharded over `mesh`; arrays already on devices
    (or traced) pass through.
    """
    if not isinstance(preprocessed_input, PreprocessedInput):
        raise TypeError(
            "preprocessed_input must be the PreprocessedInput returned by "
            f"embedding.preprocess_sparse_dense_matmul_input, got "
            f"{type(preprocessed_input).__name__}."
        )
    fields = preprocessed_input.sparse_dense_matmul_input
    names = set(fields.lhs_row_pointers)
    for mapping in fields[1:]:
        if set(mapping) != names:
            raise ValueError(
                f"The layout's arrays name different stacks: {sorted(names)} vs {sorted(mapping)}."
            )
    num_minibatches = _global_array(preprocessed_input.num_minibatches, mesh)
    return {
        name: LayoutArrays(
            *(_global_array(mapping[name], mesh) for mapping in fields), num_minibatches
        )
        for name in sorted(names)
    }


class PreparedCall(NamedTuple):
    layout: dict[str, LayoutArrays]
    geometries: tuple[StackGeometry, ...]
    treedef: Any


def prepare_call(
    preprocessed_input: PreprocessedInput,
    embedding_variables: Mapping[str, EmbeddingVariables],
    feature_specs: Nested,
    mesh: Mesh,
    enable_minibatching: bool,
) -> PreparedCall:
    """Checks the arguments of a lookup or update and derives its static sizes.

    Raises:
      ValueError: the layout, the variables and the specs disagree (stack
        names, partition count, buffer sizes, table shapes, slot names).
    """
    mesh_axis(mesh)
    layout = global_layout(preprocessed_input, mesh)
    if not layout:
        raise ValueError("preprocessed_input holds no stacked tables.")
    name = next(iter(layout))
    minibatches = NUM_BUCKETS if enable_minibatching else 1
    slots = _slots_per_device(layout[name].row_pointers.shape[0], mesh.size, minibatches, name)
    specs = prepare_feature_specs_for_training(feature_specs, mesh.size, slots)
    leaves, treedef = jax.tree.flatten(specs)
    geometries = stack_geometries(tuple(leaves), mesh.size, slots, bool(enable_minibatching))
    expected = sorted(g.name for g in geometries)
    for what, names in (
        ("preprocessed_input", layout),
        ("embedding_variables", embedding_variables),
    ):
        if sorted(names) != expected:
            raise ValueError(
                f"{what} holds stacks {sorted(names)} but feature_specs define {expected}."
            )
    for g in geometries:
        _check_layout(layout[g.name], g)
        _check_variables(embedding_variables[g.name], g)
    return PreparedCall(layout, geometries, treedef)


def _check_layout(layout: LayoutArrays, g: StackGeometry) -> None:
    sizes = {
        "row_pointers": g.devices * g.slots * g.minibatches * g.row_pointer_width,
        "embedding_ids": g.devices * g.slots * g.capacity,
        "sample_ids": g.devices * g.slots * g.capacity,
        "gains": g.devices * g.slots * g.capacity,
        "num_minibatches": g.devices,
    }
    for field, size in sizes.items():
        actual = getattr(layout, field).shape
        if actual != (size,):
            raise ValueError(
                f"Stack {g.name!r}: {field} has shape {list(actual)}, expected [{size}] for "
                f"{g.devices} devices x {g.slots} partitions and these specs' limits; "
                "preprocess with the same feature_specs and device counts."
            )


def _check_variables(variables: Any, g: StackGeometry) -> None:
    if not isinstance(variables, EmbeddingVariables):
        raise TypeError(
            f"Stack {g.name!r}: expected EmbeddingVariables (from "
            f"embedding.init_embedding_variables), got {type(variables).__name__}."
        )
    slots_type = g.optimizer.slots_type
    if type(variables.slots) is not slots_type:
        raise ValueError(
            f"Stack {g.name!r}: slots are a {type(variables.slots).__name__}, but the optimizer "
            f"{type(g.optimizer).__name__} keeps {slots_type.__name__}{slots_type._fields}."
        )
    shape = (g.partitions * g.rows, g.dim)
    expected = {
        "table": shape,
        **{f"slot {k!r}": v for k, v in g.optimizer.slot_shapes(*shape)._asdict().items()},
    }
    actual = {
        "table": variables.table,
        **{f"slot {k!r}": v for k, v in variables.slots._asdict().items()},
    }
    for what, array in actual.items():
        if tuple(array.shape) != expected[what]:
            raise ValueError(
                f"Stack {g.name!r}: {what} has shape {list(array.shape)}, expected "
                f"{list(expected[what])} for a stack of {shape[0]} rows of dim {shape[1]}."
            )


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


def _lookup_minibatch(
    entries: Entries, table: jax.Array, g: StackGeometry, axis: str, minibatch: Any
) -> jax.Array:
    """`float32[S, P, D]`: the minibatch's rows, scaled and summed per sample."""
    routing = route(entries, g, minibatch)
    owned = exchange(routing.send_rows, axis)
    rows = exchange(table.at[owned].get(mode="fill", fill_value=0), axis)
    slot = _slot_index(g)
    per_entry = rows.at[slot, routing.dest, routing.unique].get(mode="fill", fill_value=0)
    combined = jnp.zeros((g.slots, g.samples, g.dim), table.dtype)
    return combined.at[slot, entries.samples].add(per_entry * entries.gains[..., None], mode="drop")


def lookup_stack(
    layout: LayoutArrays, table: jax.Array, *, geometry: StackGeometry, axis: str
) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """One device's part of one stack's lookup (inside `shard_map`).

    Args:
      layout: this device's layout arrays.
      table: `float32[S * R, D]`, this device's shard.
      geometry: the stack's geometry.
      axis: the mesh axis.

    Returns:
      `(activations, segment)`: per feature of the stack,
      `float32[S * samples_per_slot, dim]`; and the layout's segments as
      `find_segments` gives them.
    """
    g = geometry
    segment = find_segments(layout, g)
    entries = decode(layout, g, segment)
    combined = over_minibatches(
        g,
        layout.num_minibatches,
        lambda k, total: total + _lookup_minibatch(entries, table, g, axis, k),
        jax.lax.pcast(jnp.zeros((g.slots, g.samples, g.dim), table.dtype), axis, to="varying"),
    )
    activations = tuple(
        combined[:, f.sample_offset : f.sample_offset + f.samples_per_slot, : f.dim].reshape(
            -1, f.dim
        )
        for f in g.features
    )
    return activations, segment


@functools.partial(jax.jit, static_argnames=("geometries", "mesh"))
def _forward(
    layout, tables, *, geometries: tuple[StackGeometry, ...], mesh: Mesh
) -> tuple[list, LayoutIndex]:
    axis = mesh_axis(mesh)
    spec = PartitionSpec(axis)
    activations = [None] * sum(len(g.features) for g in geometries)
    segments = []
    for g in geometries:
        lookup = jax.shard_map(
            functools.partial(lookup_stack, geometry=g, axis=axis),
            mesh=mesh,
            in_specs=(spec, spec),
            out_specs=spec,
        )
        values, segment = lookup(layout[g.name], tables[g.name])
        segments.append(segment)
        for feature, value in zip(g.features, values):
            activations[feature.index] = value
    return activations, LayoutIndex(jnp.concatenate(segments, axis=1))


def sparse_dense_matmul(
    preprocessed_input: PreprocessedInput,
    embedding_variables: Mapping[str, EmbeddingVariables],
    feature_specs: Nested,
    mesh: Mesh,
    *,
    enable_minibatching: bool = False,
    return_layout_index: bool = False,
) -> Nested | tuple[Nested, LayoutIndex]:
    """Looks up and combines the embeddings of one batch on sharded tables.

    Row `(d * S + s) * n + r` of a feature's output is sample `r` of slot `s`
    of mesh device `d` (`n` = the feature's samples per slot): the slots'
    samples in device order. With one process that is the host batch's order;
    with several, each holding consecutive devices of the mesh, a process's
    host-local row `i` is global row `process offset + i`. Jit-compatible (the
    specs and mesh are static). Differentiable with respect to the tables
    (reverse mode only without minibatching, whose loop has a data-dependent
    length).

    Args:
      preprocessed_input: from `embedding.preprocess_sparse_dense_matmul_input`
        with `global_device_count = mesh.size` (host numpy arrays, or global
        arrays over `mesh`).
      embedding_variables: `EmbeddingVariables` by stack name, from
        `embedding.init_embedding_variables` with the same S.
      feature_specs: the pytree of `FeatureSpec` the input was made with.
      mesh: 1-D mesh over all devices.
      enable_minibatching: as passed to the preprocessing (the row pointers
        then have room for 64 minibatches).
      return_layout_index: also return the `LayoutIndex` found while reading
        the layout, for `apply_gradients` of the same input.

    Returns:
      The pytree of `feature_specs` with, per feature, `float32[global_batch,
      embedding_dim]` sharded by rows over `mesh`; with `return_layout_index`,
      a pair of it and the `LayoutIndex`.

    Raises:
      ValueError: the input, variables and specs disagree.
    """
    call = prepare_call(
        preprocessed_input, embedding_variables, feature_specs, mesh, enable_minibatching
    )
    tables = {name: v.table for name, v in embedding_variables.items()}
    activations, index = _forward(call.layout, tables, geometries=call.geometries, mesh=mesh)
    activations = jax.tree.unflatten(call.treedef, activations)
    return (activations, index) if return_layout_index else activations
