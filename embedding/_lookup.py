"""The sharded forward lookup, `sparse_dense_matmul`.

Inside `jax.shard_map` over the 1-D mesh, every device, for all stacked
tables at once:
1. reads its layout (docs/design.md section 2): per slot, per partition, entries
   `(local id, sample, gain)` sorted by local id, so entries of one row are
   adjacent and the distinct rows per owner device come out of one pass
   (`_routing`);
2. sends each owner device the distinct rows it needs from it (one
   all-to-all of `int32[S, G, U]` per stack, grouped into one collective);
3. gathers the rows it owns for everyone and sends them back (one grouped
   all-to-all of `float32[S, G, U, D]`);
4. scales each entry's row by its gain and sums per sample;
5. cuts the slot's samples into the stack's features.

All buffers have static shapes from the specs' limits and the layout's buffer
size. A minibatched layout (docs/design.md section 3) holds, per slot, the
segments of minibatch 0 (partitions 0..N-1), then of minibatch 1, and so on;
the forward routes and looks up one minibatch at a time and adds up the
activations, and the update (`_update.py`) applies the minibatches one after
the other. Each row lies in one minibatch, so both equal a single pass.

Steps 1, 3 and 4 run on one of two paths (`_routing.LookupPath`), which
`prepare_call` picks once per call: the CPU kernels (`_kernel_path`) on CPU,
XLA ops (`_xla_path`, the reference of the tests) elsewhere or with
`SPARSEFLOW_CPU_KERNELS=0`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from embedding._feature_blocks import feature_activations
from embedding._malloc import keep_freed_memory
from embedding._preprocess import PreprocessedInput
from embedding._routing import LookupPath, PlanT, StackT, exchange_group, over_minibatches
from embedding._stack_geometry import (
    LayoutArrays,
    LayoutIndex,
    StackGeometry,
    prepare_call,
)
from embedding._stacking import Nested
from embedding._variables import EmbeddingVariables, mesh_axis


def lookup_stacks(
    layouts: tuple[LayoutArrays, ...],
    tables: tuple[jax.Array, ...],
    *,
    geometries: tuple[StackGeometry, ...],
    axis: str,
    path: LookupPath[StackT, PlanT],
) -> tuple[tuple[tuple[jax.Array, ...], ...], jax.Array]:
    """One device's part of the lookup of every stack (inside `shard_map`).

    Args:
      layouts: per stack, this device's layout arrays.
      tables: per stack, `float32[S * R, D]`, this device's shard.
      geometries: the stacks' geometries.
      axis: the mesh axis.
      path: the XLA path or the CPU kernels (`_routing.select_path`).

    Returns:
      `(activations, segments)`: per stack, per feature,
      `float32[S * samples_per_slot, dim]`; and the stacks' segments side by
      side, `int32[S, sum of C]` (`LayoutIndex`).
    """
    stacks = [path.read_layout(layout, g) for layout, g in zip(layouts, geometries)]

    def add_minibatch(k, totals):
        plans = [path.plan_minibatch(stack, g, k) for stack, g in zip(stacks, geometries)]
        owned = exchange_group([p.send_rows for p in plans], axis)
        gathered = [path.gather_owned(table, rows) for table, rows in zip(tables, owned)]
        received = exchange_group(gathered, axis)
        return tuple(
            total + path.pool(stack, p, rows, g)
            for total, stack, p, rows, g in zip(totals, stacks, plans, received, geometries)
        )

    zeros = tuple(
        jax.lax.pcast(jnp.zeros((g.slots, g.samples, g.dim), jnp.float32), axis, to="varying")
        for g in geometries
    )
    combined = over_minibatches(geometries[0], layouts[0].num_minibatches, add_minibatch, zeros)
    activations = tuple(feature_activations(total, g) for total, g in zip(combined, geometries))
    return activations, jnp.concatenate([stack.segment for stack in stacks], axis=1)


@functools.partial(jax.jit, static_argnames=("geometries", "mesh", "path"))
def _forward(
    layout, tables, *, geometries: tuple[StackGeometry, ...], mesh: Mesh, path: LookupPath
) -> tuple[list, LayoutIndex]:
    axis = mesh_axis(mesh)
    spec = PartitionSpec(axis)
    lookup = jax.shard_map(
        functools.partial(lookup_stacks, geometries=geometries, axis=axis, path=path),
        mesh=mesh,
        in_specs=(spec, spec),
        out_specs=spec,
    )
    values, segments = lookup(
        tuple(layout[g.name] for g in geometries), tuple(tables[g.name] for g in geometries)
    )
    activations = [None] * sum(len(g.features) for g in geometries)
    for g, stack_values in zip(geometries, values):
        for feature, value in zip(g.features, stack_values):
            activations[feature.index] = value
    return activations, LayoutIndex(segments)


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
    # Tables restored rather than created (a prediction) are looked up here
    # first: the program's temporaries then stay in the heap (`_malloc`).
    keep_freed_memory()
    call = prepare_call(
        preprocessed_input, embedding_variables, feature_specs, mesh, enable_minibatching
    )
    tables = {name: v.table for name, v in embedding_variables.items()}
    activations, index = _forward(
        call.layout, tables, geometries=call.geometries, mesh=mesh, path=call.path
    )
    activations = jax.tree.unflatten(call.treedef, activations)
    return (activations, index) if return_layout_index else activations
