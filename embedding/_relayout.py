"""Tables and slots laid out for one mesh, moved to another (docs/design.md section 1).

The sharded row order depends on the partitions `N = G * S`: id `i` of a
table with row offset `o` and rotation `r` sits at physical row
`((i mod N + r) mod N) * R + o + i div N` of its stack, `R` the stack's rows
per partition (`embedding/_variables.py`). Another device count or another
number of partitions per device moves every row, pads the vocabulary to
another multiple of `8 * N` and rotates stacked tables by another amount,
but keeps the tables, their stacks and the padded dim. Re-laying is
therefore one row gather per stack: every row of the new layout is a whole
row (padding columns included) of the old one, or a padding row, which
starts as a new table's would (zeros, the optimizer's initial slot
values). The values are copied, never recomputed, so the tables and slots
are bitwise those saved.

Like `gather_tables`, every function takes the feature specs of the layout
it reads or makes; `restack` gives the specs of a run's stacks on another
mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from embedding._stacking import Nested, stack_tables
from embedding._variables import EmbeddingVariables, StackMembers, row_sharding, stack_members


def restack(feature_specs: Nested, global_device_count: int, num_sc_per_device: int) -> Nested:
    """The same stacks of the same tables, laid out for `G * S` partitions.

    Tables stacked together stay together, in the same order, under the same
    stack name, with the default rotation (`S`), as `auto_stack_tables` and
    `stack_tables` without a `rotation` make them (a run config's stacks);
    tables of their own stay unprepared.

    Args:
      feature_specs: a pytree of `FeatureSpec` (stacked for any partitions).
      global_device_count: G of the new layout.
      num_sc_per_device: S of the new layout.
    """
    stacks: dict[str, list] = {}
    for feature in jax.tree.leaves(feature_specs):
        table = feature.table_spec
        if table.is_stacked() and table.stacked_table_spec.stack_name != table.name:
            stacks.setdefault(table.stacked_table_spec.stack_name, []).append(table)
    plain = jax.tree.map(_unprepared, feature_specs)
    for name, tables in stacks.items():
        by_offset = sorted(
            {t.name: t for t in tables}.values(),
            key=lambda t: t.setting_in_stack.row_offset_in_shard,
        )
        plain = stack_tables(
            plain,
            [t.name for t in by_offset],
            global_device_count,
            num_sc_per_device,
            stack_name=name,
        )
    return plain


def _unprepared(feature):
    table = dataclasses.replace(feature.table_spec, stacked_table_spec=None, setting_in_stack=None)
    return dataclasses.replace(feature, table_spec=table, id_transformation=None)


def _physical_rows(stacks: Mapping[str, StackMembers], partitions: int) -> dict[str, np.ndarray]:
    """Where every id of every table lies in its stack, laid out for `partitions` partitions.

    Returns:
      By table name: `int64[vocabulary_size]`, the physical row of each id in
      its stack's sharded order.
    """
    rows = {}
    for members in stacks.values():
        rows_per_partition = members.spec.stack_vocab_size // partitions
        for table in members.tables:
            setting = table.setting_in_stack
            ids = np.arange(table.vocabulary_size, dtype=np.int64)
            partition = (ids % partitions + setting.shard_rotation) % partitions
            local = setting.row_offset_in_shard + ids // partitions
            rows[table.name] = partition * rows_per_partition + local
    return rows


def embedding_variables_shapes(
    feature_specs: Nested, global_device_count: int, num_sc_per_device: int, mesh: Mesh
) -> dict[str, EmbeddingVariables]:
    """Every stack's `EmbeddingVariables` laid out for `G * S` partitions, as shapes on `mesh`.

    E.g. the target to restore variables of another layout onto this mesh's
    devices: split by rows over `mesh` where the rows divide evenly, else
    whole on every device.

    Args:
      feature_specs: pytree of `FeatureSpec`, stacked for that layout.
      global_device_count: G of the layout.
      num_sc_per_device: S of the layout.
      mesh: the 1-D mesh to place them on.

    Returns:
      `EmbeddingVariables` of float32 `jax.ShapeDtypeStruct`s by stack name.
    """
    out = {}
    for name, members in stack_members(
        feature_specs, global_device_count, num_sc_per_device
    ).items():
        shape = (members.spec.stack_vocab_size, members.spec.stack_embedding_dim)
        optimizer = members.spec.optimizer
        out[name] = EmbeddingVariables(
            _shape(shape, mesh),
            jax.tree.map(
                lambda _, slot: _shape(slot, mesh),
                optimizer.slot_initial_values(),
                optimizer.slot_shapes(*shape),
            ),
        )
    return out


def _shape(shape: tuple[int, ...], mesh: Mesh) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=_placement(shape, mesh))


def _placement(shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    return row_sharding(mesh) if shape[0] % mesh.size == 0 else NamedSharding(mesh, PartitionSpec())


def relayout_embedding_variables(
    variables: Mapping[str, EmbeddingVariables],
    from_specs: Nested,
    to_specs: Nested,
    *,
    from_devices: int,
    from_sc_per_device: int,
    to_devices: int,
    to_sc_per_device: int,
    mesh: Mesh,
) -> dict[str, EmbeddingVariables]:
    """Moves stacked tables and their slots from one layout to another.

    Args:
      variables: `EmbeddingVariables` by stack name, laid out for
        `from_specs` on `from_devices` x `from_sc_per_device` partitions, on
        any devices (e.g. restored from a checkpoint of that layout into
        `embedding_variables_shapes`).
      from_specs: pytree of `FeatureSpec`, stacked for the old layout.
      to_specs: the same features and stacks, stacked for the new layout
        (e.g. `restack(from_specs, to_devices, to_sc_per_device)`).
      from_devices: G of the old layout.
      from_sc_per_device: S of the old layout.
      to_devices: G of the new layout.
      to_sc_per_device: S of the new layout.
      mesh: a 1-D mesh to place the result on, split by rows where they
        divide evenly (always on a mesh of `to_devices` devices, the new
        layout's own), else whole on every device (e.g. one device of a
        process converting checkpoints offline).

    Returns:
      `EmbeddingVariables` by stack name in the new layout: every table's
      rows and slot rows bitwise those of `variables`, padding rows as a new
      table's.

    Raises:
      ValueError: the two specs stack the tables differently, or `variables`
        does not hold exactly the stacks of the old layout in their shapes.
    """
    old = stack_members(from_specs, from_devices, from_sc_per_device)
    new = stack_members(to_specs, to_devices, to_sc_per_device)
    _check_same_stacks(old, new)
    _check_variables(variables, old, from_devices, from_sc_per_device)
    old_rows = _physical_rows(old, from_devices * from_sc_per_device)
    new_rows = _physical_rows(new, to_devices * to_sc_per_device)
    out = {}
    for name, members in new.items():
        index = np.full(members.spec.stack_vocab_size, -1, np.int64)
        for table in members.tables:
            index[new_rows[table.name]] = old_rows[table.name]
        fill = EmbeddingVariables(0.0, members.spec.optimizer.slot_initial_values())
        out[name] = _moved(variables[name], _narrow(index), fill, mesh)
    return out


def _check_same_stacks(old: Mapping[str, StackMembers], new: Mapping[str, StackMembers]) -> None:
    def tables(stacks):
        return {name: [t.name for t in members.tables] for name, members in stacks.items()}

    if tables(old) != tables(new):
        raise ValueError(
            f"The old layout stacks the tables as {tables(old)}, the new one as {tables(new)}; "
            "re-laying moves rows within a stack, so both must make the same stacks of the "
            "same tables."
        )


def _check_variables(variables, members, devices: int, sc_per_device: int) -> None:
    layout = f"{devices} devices x {sc_per_device} partitions"
    if set(variables) != set(members):
        raise ValueError(
            f"The variables hold the stacks {sorted(variables)}, but the feature specs on "
            f"{layout} make the stacks {sorted(members)}."
        )
    for name, stack in members.items():
        table = variables[name].table
        expected = (stack.spec.stack_vocab_size, stack.spec.stack_embedding_dim)
        if tuple(table.shape) != expected:
            raise ValueError(
                f"Stack {name!r} has shape {list(table.shape)}, but on {layout} the feature "
                f"specs lay it out as {list(expected)}: the variables are of another layout."
            )


def _narrow(index: np.ndarray) -> np.ndarray:
    """`index` as int32 when it fits: XLA gathers faster, and it halves the copy to the devices."""
    return index.astype(np.int32) if index.max(initial=0) < 2**31 else index


def _moved(
    source: EmbeddingVariables, index: np.ndarray, fill: EmbeddingVariables, mesh: Mesh
) -> EmbeddingVariables:
    """`_gather_rows` of `source`, which may lie on any devices, placed on `mesh`."""
    source = jax.device_put(source, jax.tree.map(lambda x: _placement(x.shape, mesh), source))
    placed = jax.tree.map(lambda x: _placement((len(index), *x.shape[1:]), mesh), source)
    return jax.jit(_gather_rows, out_shardings=placed)(source, index, fill)


def _gather_rows(
    variables: EmbeddingVariables, index: jax.Array, fill: EmbeddingVariables
) -> EmbeddingVariables:
    """Row `index[r]` of every array of `variables` at row `r`, `fill` where it is -1."""
    kept = index >= 0
    rows = jnp.where(kept, index, 0)

    def one(values: jax.Array, value) -> jax.Array:
        mask = kept.reshape(kept.shape + (1,) * (values.ndim - 1))
        return jnp.where(mask, values[rows], jnp.asarray(value, values.dtype))

    return jax.tree.map(one, variables, fill)
