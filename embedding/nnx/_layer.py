"""`Embed`: the sharded embedding tables, their slots and their lookup as an NNX module."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import embedding
from embedding._variables import mesh_axis
from embedding.nnx._context import given
from embedding.nnx._input import check_input, on_mesh
from embedding.nnx._lookup import LookupConfig, lookup
from embedding.nnx._variables import EmbeddingParam, EmbeddingStep


class Embed(nnx.Module):
    """Sharded embedding tables with their optimizer slots, looked up per batch.

    Holds, per stacked table, the table and its optimizer's slots as
    `EmbeddingParam`s (`tables[stack]`, `slots[stack][slot name]`), created by
    `embedding.init_embedding_variables` and row-sharded as it places them,
    and an `EmbeddingStep`. Calling the layer looks up a preprocessed batch;
    differentiating through the call yields, as the "gradient" of every
    `EmbeddingParam`, its value after one step of its table's optimizer spec
    (any `embedding.OptimizerSpec`) at the layer's step. Train it
    with `PartitionedOptimizer`, which writes those values back.

    Call the layer exactly once in a loss that is differentiated: two calls
    would add up two updated tables (see `PartitionedOptimizer`). Outside a
    differentiated loss (evaluation), call it as often as needed. Under
    `provided_activations` the layer returns activations computed elsewhere
    (a trainer's sparse stage) instead of looking up.

    Attributes:
      tables: `EmbeddingParam` `float32[stack_vocab_size, stack_embedding_dim]`
        by stack name, in sharded row order.
      slots: per stack name, the slot variables of its optimizer by slot name
        (e.g. `accumulator`), `EmbeddingParam`s of the table's shape or, per
        row, `float32[stack_vocab_size]`; empty for SGD.
      step: `EmbeddingStep`, `int32[]`, the sparse updates applied so far.
    """

    def __init__(
        self,
        feature_specs: Any,
        mesh: Mesh,
        *,
        num_sc_per_device: int,
        rngs: nnx.Rngs,
        enable_minibatching: bool = False,
    ):
        """Creates the tables and slots of `feature_specs`, sharded over `mesh`.

        Args:
          feature_specs: a pytree of `embedding.FeatureSpec` (prepared or not;
            stacked with `embedding.stack_tables` or not).
          mesh: 1-D mesh over all devices (`G = mesh.size`).
          num_sc_per_device: S, partitions per device; `G * S` a power of two.
          rngs: the tables' initializers get `rngs.params()` (as the key of
            `embedding.init_embedding_variables`).
          enable_minibatching: as passed to the preprocessing.
        """
        axis = mesh_axis(mesh)
        specs = embedding.prepare_feature_specs_for_training(
            feature_specs, mesh.size, num_sc_per_device
        )
        leaves, treedef = jax.tree.flatten(specs)
        self._config = LookupConfig(
            tuple(leaves), treedef, mesh, num_sc_per_device, bool(enable_minibatching)
        )
        variables = embedding.init_embedding_variables(
            rngs.params(), specs, mesh, num_sc_per_device=num_sc_per_device
        )
        # The sharding as metadata, so that nnx.get_named_sharding (and
        # state_shardings) give jit the sharding the arrays already have.
        rows = {"out_sharding": (axis,), "mesh": mesh}
        self.tables = nnx.Dict(
            {name: EmbeddingParam(v.table, **rows) for name, v in variables.items()}
        )
        self.slots = nnx.Dict(
            {
                name: nnx.Dict(
                    {
                        slot: EmbeddingParam(value, **rows)
                        for slot, value in v.slots._asdict().items()
                    }
                )
                for name, v in variables.items()
            }
        )
        self.step = EmbeddingStep(
            jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, PartitionSpec()))
        )

    @property
    def feature_specs(self) -> Any:
        """The prepared feature specs, in the structure given; preprocess batches with them."""
        return self._config.feature_specs

    @property
    def mesh(self) -> Mesh:
        """The 1-D mesh the tables are sharded over."""
        return self._config.mesh

    @property
    def num_sc_per_device(self) -> int:
        """S, partitions per device; preprocess batches with it."""
        return self._config.num_sc_per_device

    @property
    def enable_minibatching(self) -> bool:
        """Whether batches are preprocessed with minibatching."""
        return self._config.enable_minibatching

    @property
    def input_sharding(self) -> NamedSharding:
        """The sharding of a `PreprocessedInput`'s leaves (dim 0 over the mesh),
        for `nnx.jit`'s `in_shardings`; also that of the activations' rows."""
        return NamedSharding(self.mesh, PartitionSpec(mesh_axis(self.mesh)))

    def embedding_variables(self) -> dict[str, embedding.EmbeddingVariables]:
        """The current tables and slots as `EmbeddingVariables` by stack name,
        as `embedding.sparse_dense_matmul` and `embedding.gather_tables` take them."""
        stacks = embedding.get_stacked_table_specs(self.feature_specs)
        return {
            name: embedding.EmbeddingVariables(
                table[...],
                stacks[name].optimizer.slots_type(
                    **{slot: value[...] for slot, value in self.slots[name].items()}
                ),
            )
            for name, table in self.tables.items()
        }

    def __call__(self, preprocessed_input: embedding.PreprocessedInput | None) -> Any:
        """Looks up one batch, or returns the activations given to this layer.

        Under `provided_activations` that gives this layer activations, the
        call returns them as they are: the tables are not read (the loss
        does not depend on them) and the step is left alone.

        Args:
          preprocessed_input: from `embedding.preprocess_sparse_dense_matmul_input`
            with this layer's `feature_specs`, `global_device_count = mesh.size`,
            its `num_sc_per_device` and `enable_minibatching`: host numpy arrays
            (this process's devices) or global arrays over the mesh. With
            given activations it is checked but not read, and may be None.

        Returns:
          The pytree of `feature_specs` (a dict by feature name for a dict of
          specs) with, per feature, `float32[global_batch, embedding_dim]`,
          rows split over the mesh; or the given activations.

        Raises:
          TypeError: `preprocessed_input` is not a `PreprocessedInput` (nor None
            with given activations).
          ValueError: it was preprocessed for other specs or another geometry.
        """
        activations = given(self._config)
        if activations is not None:
            if preprocessed_input is not None:
                check_input(preprocessed_input, self._config)
            return activations
        check_input(preprocessed_input, self._config)
        return lookup(
            self._config,
            self.embedding_variables(),
            self.step[...],
            on_mesh(preprocessed_input, self.mesh),
        )


def embed_layers(node: Any) -> dict[str, Embed]:
    """The `Embed` layers of `node` by their path in it (`"tower/embed"`; `""`
    for `node` itself), in `nnx.iter_graph` order; a shared layer once.

    Raises:
      ValueError: `node` holds no `Embed` layer.
    """
    layers = {
        "/".join(map(str, path)): value
        for path, value in nnx.iter_graph(node)
        if isinstance(value, Embed)
    }
    if not layers:
        raise ValueError(
            f"{type(node).__name__} holds no embedding.nnx.Embed layer; pass the model "
            "that holds the layer."
        )
    return layers


def embed_mesh(node: Any) -> Mesh:
    """The mesh of the `Embed` layers in `node`.

    Raises:
      ValueError: `node` holds no `Embed` layer, or layers on different meshes.
    """
    meshes = {layer.mesh for layer in embed_layers(node).values()}
    if len(meshes) > 1:
        raise ValueError(
            f"{type(node).__name__} holds Embed layers on {len(meshes)} different meshes; "
            "its state has no one sharding."
        )
    return meshes.pop()
