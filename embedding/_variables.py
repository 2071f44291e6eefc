"""Embedding variables: stacked tables MOD-sharded row-wise over a 1-D mesh.

The sharded row order (docs/design.md sections 1 and 5). With `G` devices and `S`
partitions per device there are `N = G * S` partitions. Id `i` of a table
stacked with row offset `o` (`setting_in_stack.row_offset_in_shard`) and
rotation `r` (`setting_in_stack.shard_rotation`) lives in partition
`p = (i + r) mod N` at local row `o + i div N`; a table of its own has
`o = r = 0`, so id `i` is in partition `i mod N` at row `i div N`.

A stacked table is one `jax.Array` `float32[N * R, D]`, with `R =
stack_vocab_size / N` rows per partition and `D` the padded dim, sharded on
dim 0 over the mesh axis: row `r` of partition `p` is physical row `p * R + r`,
so device `g` holds partitions `g*S .. g*S + S - 1`, one after the other.
Optimizer slots are arrays of the same sharding, of the table's shape or, for
a per-row slot (row-wise Adagrad), `[N * R]`. Padding rows
(ids past the vocabulary) and padding columns (past the table's dim) exist
only in the sharded order; the logical view of a table is
`[vocabulary_size, embedding_dim]`.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from embedding._initializers import Constant, Normal, TruncatedNormal, Uniform
from embedding._malloc import keep_freed_memory
from embedding._row_draws import draw_rows, draws_by_counter
from embedding._specs import StackedTableSpec, TableSpec
from embedding._stacking import Nested, prepare_feature_specs_for_training


class EmbeddingVariables(NamedTuple):
    """One stacked table and its optimizer slots, sharded as the module says.

    Attributes:
      table: `float32[stack_vocab_size, stack_embedding_dim]` in sharded row order.
      slots: the slot variables of the stack's optimizer, its `slots_type`
        (e.g. `AdagradSlots(accumulator)`), each of `table`'s sharding and of
        the shape `optimizer.slot_shapes(stack_vocab_size, stack_embedding_dim)`.
    """

    table: jax.Array
    slots: Any


class StackMembers(NamedTuple):
    """A stacked table and its logical tables in row-offset order."""

    spec: StackedTableSpec
    tables: tuple[TableSpec, ...]


def mesh_axis(mesh: Mesh) -> str:
    """The name of `mesh`'s only axis.

    Raises:
      ValueError: the mesh is not one-dimensional.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if len(mesh.axis_names) != 1:
        raise ValueError(
            f"Embedding tables shard over a 1-D mesh; got axes {mesh.axis_names} of "
            f"shape {dict(mesh.shape)}. Build one with jax.sharding.Mesh(devices, ('x',))."
        )
    return mesh.axis_names[0]


def row_sharding(mesh: Mesh) -> NamedSharding:
    """Dim 0 split over the mesh's axis: the sharding of tables, slots and layouts."""
    return NamedSharding(mesh, PartitionSpec(mesh_axis(mesh)))


def stack_members(
    feature_specs: Nested, global_device_count: int, num_sc_per_device: int
) -> dict[str, StackMembers]:
    """The stacks of `feature_specs` (prepared for `G * S` partitions), by name."""
    specs = prepare_feature_specs_for_training(
        feature_specs, global_device_count, num_sc_per_device
    )
    tables: dict[str, dict[str, TableSpec]] = {}
    for feature in jax.tree.leaves(specs):
        table = feature.table_spec
        tables.setdefault(table.stacked_table_spec.stack_name, {})[table.name] = table
    return {
        name: StackMembers(
            next(iter(members.values())).stacked_table_spec,
            tuple(sorted(members.values(), key=lambda t: t.setting_in_stack.row_offset_in_shard)),
        )
        for name, members in tables.items()
    }


def table_key(key: jax.Array, table_name: str) -> jax.Array:
    """The key a table's initializer gets: `key` folded with the name's CRC-32.

    It depends on nothing but the seed and the name, so a table starts the same
    whatever the device count, partitions or stacking.
    """
    return jax.random.fold_in(key, _name_hash(table_name))


def _name_hash(table_name: str) -> int:
    return zlib.crc32(table_name.encode()) & 0x7FFFFFFF


def _namespace(x: Any):
    """numpy for host arrays (no device round trip), else jax.numpy."""
    return np if isinstance(x, np.ndarray) else jnp


def _unrotated_blocks(values: Any, setting, num_partitions: int) -> Any:
    """`[n, vocabulary_size, embedding_dim]` -> `[n, N, padded_vocab_size / N,
    padded_embedding_dim]`, zero padded: `[i, q, r]` holds table `i`'s id
    `r*N + q`."""
    xp = _namespace(values)
    values = xp.pad(
        values,
        (
            (0, 0),
            (0, setting.padded_vocab_size - values.shape[1]),
            (0, setting.padded_embedding_dim - values.shape[2]),
        ),
    )
    by_partition = values.reshape(values.shape[0], -1, num_partitions, values.shape[2])
    return by_partition.transpose(0, 2, 1, 3)


def _partition_blocks(values: Any, tables: Sequence[TableSpec], num_partitions: int) -> list[Any]:
    """Tables of one shape and padding, each split into its partitions' rows.

    Args:
      values: `[n, vocabulary_size, embedding_dim]`, table `i` of `tables` in
        logical order at `[i]`.
      tables: the n prepared specs.
      num_partitions: N.

    Returns:
      Per table, `[N, padded_vocab_size / N, padded_embedding_dim]`, zero
      padded: `[p]` holds the rows the table keeps in partition `p`.
    """
    xp = _namespace(values)
    by_partition = _unrotated_blocks(values, tables[0].setting_in_stack, num_partitions)
    # Id r*N + q lives in partition (q + rotation) mod N.
    return [
        xp.roll(by_partition[i], table.setting_in_stack.shard_rotation, axis=0)
        for i, table in enumerate(tables)
    ]


def to_sharded_order(
    logical: Sequence[Any], tables: Sequence[TableSpec], num_partitions: int
) -> Any:
    """Stacks logical tables into sharded row order.

    Args:
      logical: per table of the stack (row-offset order), `[vocabulary_size,
        embedding_dim]`; numpy arrays give a numpy result.
      tables: the prepared specs of those tables.
      num_partitions: N.

    Returns:
      `[stack_vocab_size, padded_dim]`, zero padded.
    """
    blocks = [
        _partition_blocks(values[None], [table], num_partitions)[0]
        for values, table in zip(logical, tables, strict=True)
    ]
    stacked = _namespace(blocks[0]).concatenate(blocks, axis=1)
    return stacked.reshape(-1, stacked.shape[2])


def to_logical_order(sharded: Any, tables: Sequence[TableSpec], num_partitions: int) -> list[Any]:
    """Inverse of `to_sharded_order`: `[stack_vocab, D]` -> per table `[vocab, dim]`."""
    xp = _namespace(sharded)
    by_partition = sharded.reshape(num_partitions, -1, sharded.shape[1])
    logical = []
    for table in tables:
        setting = table.setting_in_stack
        start = setting.row_offset_in_shard
        block = by_partition[:, start : start + setting.padded_vocab_size // num_partitions]
        block = xp.roll(block, -setting.shard_rotation, axis=0).transpose(1, 0, 2)
        block = block.reshape(-1, block.shape[2])
        logical.append(block[: table.vocabulary_size, : table.embedding_dim])
    return logical


def _alike(tables: Sequence[TableSpec]) -> list[list[int]]:
    """The indices of `tables` grouped by initializer, shape and padding, in order."""
    groups: dict[tuple, list[int]] = {}
    for i, table in enumerate(tables):
        setting = table.setting_in_stack
        shape = (table.vocabulary_size, table.embedding_dim)
        padding = (setting.padded_vocab_size, setting.padded_embedding_dim)
        # Initializers are compared, not hashed: any callable may be one.
        same = next(
            (k for k in groups if k[0] == table.initializer and k[1:] == (shape, padding)), None
        )
        groups.setdefault(same or (table.initializer, shape, padding), []).append(i)
    return list(groups.values())


def _drawn_by_id(initializer, key: jax.Array) -> bool:
    """Whether `initializer`'s value for an entry depends only on its index in
    the flattened table (not on the shape drawn), so that a table can be drawn
    a block of rows at a time: true of this package's initializers under
    `draws_by_counter` keys."""
    return isinstance(initializer, (Constant, Normal, TruncatedNormal, Uniform)) and (
        draws_by_counter(key)
    )


def _rotated(block: jax.Array, rotations: Sequence[int], i: jax.Array) -> jax.Array:
    """`block` (`[N, rows, dim]`) rolled along partitions by `rotations[i]`.

    One branch per distinct rotation, each a roll by a constant: a roll by a
    traced count gathered the whole table on every device.
    """
    distinct = sorted(set(rotations))
    branches = [functools.partial(jnp.roll, shift=r, axis=0) for r in distinct]
    if len(branches) == 1:
        return branches[0](block)
    index = jnp.asarray([distinct.index(r) for r in rotations], jnp.int32)[i]
    return jax.lax.switch(index, branches, block)


def _init_stack(key: jax.Array, members: StackMembers, num_partitions: int, sharding):
    # Each table is drawn and laid out into its place in the stack in turn, by
    # one loop per group of alike tables (one copy of the generator in the
    # program, which stays quick to compile and to load from the compilation
    # cache, docs/benchmarks.md). Drawing a group at once held three times the
    # group in XLA:CPU's random-number temporaries; in turn they are those of
    # the largest table, and the stack is written in place.
    tables = members.tables
    first_setting = tables[0].setting_in_stack
    rows_before = np.cumsum(
        [0] + [t.setting_in_stack.padded_vocab_size // num_partitions for t in tables]
    )
    stacked = jnp.zeros(
        (num_partitions, int(rows_before[-1]), first_setting.padded_embedding_dim), jnp.float32
    )
    stacked = jax.lax.with_sharding_constraint(stacked, _partition_sharding(sharding))
    for indices in _alike(tables):
        group = [tables[i] for i in indices]
        stacked = _draw_group(key, group, rows_before[indices], stacked, sharding)
    table = stacked.reshape(-1, stacked.shape[2])
    optimizer = members.spec.optimizer
    slots = jax.tree.map(
        lambda value, shape: jnp.full(shape, value, jnp.float32),
        optimizer.slot_initial_values(),
        optimizer.slot_shapes(*table.shape),
    )
    return EmbeddingVariables(table, slots)


def _partition_sharding(sharding: NamedSharding) -> NamedSharding:
    """`[N, rows per partition, dim]` split by partitions as `sharding` splits rows."""
    return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec, None))


def _draw_group(
    key: jax.Array,
    group: Sequence[TableSpec],
    rows_before: np.ndarray,
    stacked: jax.Array,
    sharding: NamedSharding,
) -> jax.Array:
    """`stacked` with each table of `group` (alike) drawn into its partitions' rows.

    Args:
      group: tables of one initializer, shape and padding.
      rows_before: `int[len(group)]`, each table's first row in every partition.
      stacked: `float32[N, rows per partition, padded_dim]`.
      sharding: the stacked table's row sharding.
    """
    first = group[0]
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
        key, np.array([_name_hash(t.name) for t in group], np.uint32)
    )  # table_key's
    starts = jnp.asarray(rows_before, jnp.int32)
    if _drawn_by_id(first.initializer, key):
        return _draw_group_by_blocks(keys, group, starts, stacked, sharding)
    # Any other initializer draws the logical table; pinning it to the row
    # sharding makes every device draw only its own rows, which then move to
    # the partitions that hold them.
    setting = first.setting_in_stack
    num_partitions = stacked.shape[0]
    rotations = [t.setting_in_stack.shard_rotation for t in group]
    shape = (first.vocabulary_size, first.embedding_dim)

    def place(i, stacked):
        values = first.initializer(keys[i], shape, jnp.float32).astype(jnp.float32)
        values = jax.lax.with_sharding_constraint(values, sharding)
        block = _unrotated_blocks(values[None], setting, num_partitions)[0]
        block = _rotated(block, rotations, i)
        return jax.lax.dynamic_update_slice(stacked, block, (0, starts[i], 0))

    return jax.lax.fori_loop(0, len(group), place, stacked)


# Entries drawn at once (over all devices): XLA:CPU's random-number temporaries are
# a few times the block they draw, a small part of any large table.
_ENTRIES_PER_DRAW = 2**21


def _draw_group_by_blocks(
    keys: jax.Array,
    group: Sequence[TableSpec],
    starts: jax.Array,
    stacked: jax.Array,
    sharding: NamedSharding,
) -> jax.Array:
    """`_draw_group` of `_drawn_by_id` initializers, a block of rows at a time.

    A table is drawn as `[rows per partition, N, dim]`: entry `[a, q]` is id
    `a*N + q`'s, as in the logical draw, and each device draws only its
    partitions' ids, so a table moves between devices only by its rotation.
    Blocks of `a` are drawn in turn (`draw_rows`), each put in its place.
    """
    first = group[0]
    setting = first.setting_in_stack
    num_partitions = stacked.shape[0]
    rotations = [t.setting_in_stack.shard_rotation for t in group]
    by_id = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec, None))
    rows = setting.padded_vocab_size // num_partitions
    shape = (rows, num_partitions, first.embedding_dim)
    block_rows = min(rows, max(1, _ENTRIES_PER_DRAW // (num_partitions * first.embedding_dim)))
    # The last block ends at the last row, overlapping the one before: its
    # rows are drawn twice, alike.
    first_rows = np.minimum(np.arange(0, rows, block_rows), rows - block_rows)
    full_rows, rest = divmod(first.vocabulary_size, num_partitions)

    def place(j, stacked):
        i, b = jnp.divmod(j, len(first_rows))
        first_row = jnp.asarray(first_rows, jnp.int32)[b]
        values = draw_rows(first.initializer, keys[i], shape, first_rows, b, block_rows)
        values = jax.lax.with_sharding_constraint(values, by_id)
        # Id a*N + q is a table row iff a*N + q < vocab, compared without the
        # product (no overflow) and from iotas (no id array in the program).
        a = jax.lax.broadcasted_iota(jnp.int32, values.shape[:2], 0) + first_row
        q = jax.lax.broadcasted_iota(jnp.int32, values.shape[:2], 1)
        in_table = (a < full_rows) | ((a == full_rows) & (q < rest))
        values = jnp.where(in_table[:, :, None], values, 0.0)
        values = jnp.pad(
            values, ((0, 0), (0, 0), (0, setting.padded_embedding_dim - first.embedding_dim))
        )
        block = _rotated(values.transpose(1, 0, 2), rotations, i)
        return jax.lax.dynamic_update_slice(stacked, block, (0, starts[i] + first_row, 0))

    return jax.lax.fori_loop(0, len(group) * len(first_rows), place, stacked)


def init_embedding_variables(
    key: jax.Array, feature_specs: Nested, mesh: Mesh, *, num_sc_per_device: int
) -> dict[str, EmbeddingVariables]:
    """Creates every stacked table and its slots, sharded over `mesh`.

    Table `t` starts as `t.initializer(table_key(key, t.name),
    (t.vocabulary_size, t.embedding_dim), float32)` in logical order, so the
    values of an id depend only on the seed and the table, not on the mesh,
    the partitions or the stacking. Each device computes only its own shard
    (one jitted program with sharded outputs); slots start at the optimizer's
    initial values.

    On glibc, the process's malloc then keeps the memory a step frees for the
    next step (`_malloc.keep_freed_memory`).

    Args:
      key: a `jax.random` key.
      feature_specs: pytree of `FeatureSpec` (prepared or not).
      mesh: 1-D mesh over all devices (`G = mesh.size`).
      num_sc_per_device: S, partitions per device; `G * S` a power of two.

    Returns:
      `EmbeddingVariables` by stack name.
    """
    keep_freed_memory()
    return init_program(feature_specs, mesh, num_sc_per_device)(key)


def init_program(feature_specs: Nested, mesh: Mesh, num_sc_per_device: int):
    """The jitted `key -> {stack name: EmbeddingVariables}` behind
    `init_embedding_variables` (exposed to inspect its compiled form)."""
    return _init_program(tuple(jax.tree.leaves(feature_specs)), mesh, num_sc_per_device)


@functools.lru_cache(maxsize=32)
def _init_program(leaves: tuple, mesh: Mesh, num_sc_per_device: int):
    sharding = row_sharding(mesh)
    num_partitions = mesh.size * num_sc_per_device
    stacks = stack_members(list(leaves), mesh.size, num_sc_per_device)
    return jax.jit(
        lambda key: {
            name: _init_stack(key, members, num_partitions, sharding)
            for name, members in stacks.items()
        },
        out_shardings=sharding,
    )


def shard_tables(
    tables: Mapping[str, Any], feature_specs: Nested, mesh: Mesh, *, num_sc_per_device: int
) -> dict[str, jax.Array]:
    """Puts logical tables (or slot values) into sharded row order on `mesh`.

    Args:
      tables: `[vocabulary_size, embedding_dim]` per table name; every table of
        a stack that is present must have all its stack's tables.
      feature_specs: pytree of `FeatureSpec`.
      mesh: 1-D mesh (`G = mesh.size`).
      num_sc_per_device: S.

    Returns:
      `float32[stack_vocab_size, padded_dim]` by stack name, sharded by rows.

    Raises:
      ValueError: a table is unknown, missing from its stack, or misshapen.
    """
    stacks = stack_members(feature_specs, mesh.size, num_sc_per_device)
    known = {t.name for members in stacks.values() for t in members.tables}
    unknown = sorted(set(tables) - known)
    if unknown:
        raise ValueError(f"shard_tables: unknown tables {unknown}; known: {sorted(known)}.")
    out = {}
    for name, members in stacks.items():
        present = [t.name for t in members.tables if t.name in tables]
        if not present:
            continue
        if len(present) != len(members.tables):
            missing = [t.name for t in members.tables if t.name not in tables]
            raise ValueError(
                f"shard_tables: stack {name!r} also needs tables {missing} (given "
                f"{present}); pass every table of a stack."
            )
        logical = [_logical_array(tables[t.name], t) for t in members.tables]
        out[name] = _sharded_fn(members.tables, mesh, num_sc_per_device)(logical)
    return out


def _logical_array(values: Any, table: TableSpec) -> np.ndarray:
    values = np.asarray(values, dtype=np.float32)
    expected = (table.vocabulary_size, table.embedding_dim)
    if values.shape != expected:
        raise ValueError(
            f"Table {table.name!r}: expected values of shape {list(expected)} "
            f"[vocabulary_size, embedding_dim], got {list(values.shape)}."
        )
    return values


@functools.lru_cache(maxsize=32)
def _sharded_fn(tables: tuple[TableSpec, ...], mesh: Mesh, num_sc_per_device: int):
    return jax.jit(
        functools.partial(
            to_sharded_order, tables=tables, num_partitions=mesh.size * num_sc_per_device
        ),
        out_shardings=row_sharding(mesh),
    )


def gather_tables(
    stacks: Mapping[str, Any], feature_specs: Nested, mesh: Mesh, *, num_sc_per_device: int
) -> dict[str, np.ndarray]:
    """Copies sharded stacks to the host as logical tables, for inspection.

    Works for tables and for slot variables alike (pass `{name:
    variables[name].slots.accumulator}`). The whole table lands in host
    memory: use it for checks and exports, not in training.

    Args:
      stacks: `[stack_vocab_size, padded_dim]` (or a per-row slot
        `[stack_vocab_size]`) by stack name, sharded order.
      feature_specs: pytree of `FeatureSpec`.
      mesh: the mesh the stacks were made for (`G = mesh.size`).
      num_sc_per_device: S they were made for.

    Returns:
      `float32[vocabulary_size, embedding_dim]` (`[vocabulary_size]` for a
      per-row slot) numpy arrays by table name.

    Raises:
      ValueError: an unknown stack name or a wrong shape.
    """
    members = stack_members(feature_specs, mesh.size, num_sc_per_device)
    num_partitions = mesh.size * num_sc_per_device
    out = {}
    for name, values in stacks.items():
        if name not in members:
            raise ValueError(f"gather_tables: unknown stack {name!r}; known: {sorted(members)}.")
        spec = members[name].spec
        expected = (spec.stack_vocab_size, spec.stack_embedding_dim)
        if tuple(values.shape) not in (expected, expected[:1]):
            raise ValueError(
                f"gather_tables: stack {name!r} has shape {list(values.shape)}, expected "
                f"{list(expected)} (or {list(expected[:1])} for a per-row slot)."
            )
        host = (
            np.asarray(values)
            if getattr(values, "is_fully_addressable", True)
            else multihost_utils.process_allgather(values, tiled=True)
        )
        per_row = host.ndim == 1
        logical = to_logical_order(
            host[:, None] if per_row else host, members[name].tables, num_partitions
        )
        out.update(
            {
                t.name: np.ascontiguousarray(v[:, 0] if per_row else v)
                for t, v in zip(members[name].tables, logical)
            }
        )
    return out
