"""A Flax NNX layer over sharded embedding tables.

`Embed` holds the stacked tables and their optimizer slots as
`EmbeddingParam`s and looks up preprocessed batches. Differentiating through
it runs each table's sparse optimizer in the backward pass, whose
"gradient" of a table is the updated table; `PartitionedOptimizer` writes
those back and runs optax on every other parameter. `state_shardings` gives
`nnx.jit` the state's shardings. `provided_activations` runs a model with
activations computed elsewhere in place of its layers' lookups (the dense
stage of a trainer that splits the model), and `embed_layers` finds a
model's layers. docs/design.md section 5 ("The NNX layer") describes the
design. With the NNX towers of `sparseflow.towers`, this is the only part of
sparseflow that imports flax.

A train step over all devices (a batch of 64 splits over up to 64):

>>> import jax, jax.numpy as jnp, numpy as np, optax
>>> from flax import nnx
>>> import embedding
>>> from embedding import nnx as enx
>>> mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
>>> table = embedding.TableSpec(
...     name="item", vocabulary_size=1000, embedding_dim=8,
...     initializer=embedding.initializers.Normal(stddev=0.1),
...     optimizer=embedding.RowWiseAdagradOptimizerSpec(learning_rate=0.1),
...     combiner="mean")
>>> specs = {"item": embedding.FeatureSpec(
...     name="item", table_spec=table, input_shape=[64, 3], output_shape=[64, 8])}
>>> class Model(nnx.Module):
...     def __init__(self, rngs):
...         self.embed = enx.Embed(specs, mesh, num_sc_per_device=1, rngs=rngs)
...         self.head = nnx.Linear(8, 1, rngs=rngs)
...     def __call__(self, batch):
...         return self.head(self.embed(batch)["item"])[:, 0]
>>> model = Model(nnx.Rngs(0))
>>> optimizer = enx.PartitionedOptimizer(model, optax.adam(1e-3))
>>> @nnx.jit(
...     in_shardings=(enx.state_shardings(model), enx.state_shardings(optimizer),
...                   model.embed.input_sharding, None),
...     donate_argnames=("model", "optimizer"))
... def train_step(model, optimizer, batch, labels):
...     def loss_fn(model):
...         return jnp.mean((model(batch) - labels) ** 2)
...     loss, grads = nnx.value_and_grad(loss_fn)(model)
...     optimizer.update(model, grads)  # tables: replaced; head: adam
...     return loss
>>> ids = np.random.default_rng(0).integers(0, 1000, (64, 3))
>>> batch, _ = embedding.preprocess_sparse_dense_matmul_input(
...     {"item": ids}, None, model.embed.feature_specs, mesh.size, mesh.size,
...     num_sc_per_device=1)
>>> loss = train_step(model, optimizer, batch, jnp.ones(64))
>>> rows = jax.sharding.PartitionSpec("x")
>>> int(model.embed.step[...]), model.embed.tables["item"][...].sharding.spec == rows
(1, True)
"""

from embedding.nnx._layer import Embed, embed_layers
from embedding.nnx._optimizer import PartitionedOptimizer
from embedding.nnx._provided import provided_activations
from embedding.nnx._shardings import state_shardings
from embedding.nnx._variables import EmbeddingParam, EmbeddingStep

__all__ = [
    "Embed",
    "EmbeddingParam",
    "EmbeddingStep",
    "PartitionedOptimizer",
    "embed_layers",
    "provided_activations",
    "state_shardings",
]
