"""The shardings of a model's or optimizer's state, for `nnx.jit`."""

from __future__ import annotations

from flax import nnx

from embedding.nnx._layer import embed_mesh
from embedding.nnx._optimizer import PartitionedOptimizer


def state_shardings(node: nnx.Module | PartitionedOptimizer) -> nnx.StateSharding:
    """The sharding of every variable of `node`, as `nnx.jit`'s `in_shardings` take it.

    `EmbeddingParam`s are row-sharded over the layers' mesh (as
    `embedding.init_embedding_variables` places them); every other variable
    follows its `out_sharding` metadata, or is replicated without one. Pass
    it for the model and the optimizer arguments of a jitted train step:
    nnx.jit keeps the same shardings for the updated state, so the tables
    stay where they are from step to step.

    Args:
      node: a module holding `Embed` layers (all on one mesh), or its
        `PartitionedOptimizer`.

    Returns:
      An `nnx.StateSharding` of `NamedSharding`s on the layers' mesh.

    Raises:
      TypeError: `node` is an `nnx.Optimizer` other than `PartitionedOptimizer`
        (which would take an optax step on the tables' updated values).
      ValueError: a module holds no `Embed` layer, or layers on several meshes.
    """
    if isinstance(node, PartitionedOptimizer):
        mesh = node.mesh
    elif isinstance(node, nnx.Optimizer):
        raise TypeError(
            f"state_shardings got a {type(node).__name__}; a model with Embed layers "
            "trains with embedding.nnx.PartitionedOptimizer, whose update writes the "
            "tables' updated values back (an optax step on them would corrupt the tables)."
        )
    else:
        mesh = embed_mesh(node)
    return nnx.StateSharding(nnx.get_named_sharding(nnx.state(node), mesh))
