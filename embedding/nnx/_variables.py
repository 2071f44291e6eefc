"""The variable types an `Embed` layer keeps in the model's state."""

from __future__ import annotations

from flax import nnx


class EmbeddingParam(nnx.Param):
    """A stacked table or one of its optimizer slots, held by an `Embed` layer.

    A `Param`, so `nnx.grad` and `nnx.value_and_grad` differentiate it by
    default; its "gradient" is its updated value (the lookup's backward runs
    the table's sparse optimizer), which `PartitionedOptimizer` writes back
    instead of taking an optax step. Filter with `nnx.state(model,
    EmbeddingParam)`.

    Values: `float32[stack_vocab_size, stack_embedding_dim]` for a table,
    the table's shape or `float32[stack_vocab_size]` for a slot, in sharded
    row order, rows split over the layer's mesh (`out_sharding` metadata).
    """


class EmbeddingStep(nnx.Variable):
    """`int32[]`: sparse updates applied to an `Embed` layer's tables so far.

    The step the tables' optimizers see (learning-rate schedules, Adam's bias
    correction): 0 for the first update. Not a `Param`, so it is never
    differentiated; `PartitionedOptimizer.update` advances it.
    """
