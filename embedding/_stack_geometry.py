"""The static sizes of a sharded lookup and the checks of its arguments.

Every lookup and update starts here: the layout's arrays become global
arrays over the mesh, the partitions per device are read off the row
pointers, and each stacked table gets its `StackGeometry` (the buffer sizes
all programs are compiled for). The arguments are checked against the specs
before anything is traced, so a mismatch is a clear error, not a shape error
deep inside `shard_map`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from embedding._layout import ALIGNMENT
from embedding._minibatch import NUM_BUCKETS
from embedding._optimizer_updates import check_optimizer
from embedding._optimizers import OptimizerSpec
from embedding._preprocess import PreprocessedInput, _plan
from embedding._routing import LookupPath, select_path
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
    """The checked arguments of a lookup or update and what it runs on.

    Attributes:
      layout: every stack's layout arrays over the mesh, by stack name.
      geometries: the stacks' geometries, in the order the specs first name
        the stacks.
      treedef: the structure of the feature specs.
      path: the XLA path or the CPU kernels, for the mesh's platform
        (`_routing.select_path`).
    """

    layout: dict[str, LayoutArrays]
    geometries: tuple[StackGeometry, ...]
    treedef: Any
    path: LookupPath


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
    path = select_path(mesh.devices.flat[0].platform)
    return PreparedCall(layout, geometries, treedef, path)


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
