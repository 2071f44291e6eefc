"""The shipped dense towers, DLRM and DCN-v2, as Flax NNX modules over an `Embed` layer,
and `TwoTower`, a retrieval model (docs/retrieval.md).

`Dlrm` and `DcnV2` take an `embedding.nnx.Embed` layer and compute the
logits of `sparseflow._model.forward` from its activations and the dense
features; they train with `embedding.nnx.PartitionedOptimizer` like any
model holding the layer, and they are what `sparseflow train` runs for a
config's `model.tower`. `from_config` builds the tower of a run config's
`model` section, and `dense_params()` and `load_dense_params(params)`
convert its parameters to and from the plain dict of
`sparseflow._model.init_params`. docs/design.md section 5 ("The NNX layer") describes them.

>>> import jax, numpy as np
>>> from flax import nnx
>>> import embedding
>>> from embedding import nnx as enx
>>> from sparseflow import towers
>>> mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
>>> table = embedding.TableSpec(
...     name="item", vocabulary_size=1000, embedding_dim=8,
...     initializer=embedding.initializers.Normal(stddev=0.1),
...     optimizer=embedding.SGDOptimizerSpec(learning_rate=0.1), combiner="mean")
>>> specs = {"item": embedding.FeatureSpec(
...     name="item", table_spec=table, input_shape=[64, 3], output_shape=[64, 8])}
>>> embed = enx.Embed(specs, mesh, num_sc_per_device=1, rngs=nnx.Rngs(0))
>>> model = towers.Dlrm(embed, 13, bottom_mlp=[32, 8], top_mlp=[16], rngs=nnx.Rngs(1))
>>> batch, _ = embedding.preprocess_sparse_dense_matmul_input(
...     {"item": np.random.default_rng(0).integers(0, 1000, (64, 3))}, None,
...     embed.feature_specs, mesh.size, mesh.size, num_sc_per_device=1)
>>> logits = model(batch, np.zeros((64, 13), np.float32))
>>> logits.shape, sorted(model.dense_params())
((64,), ['bottom', 'project', 'top'])
>>> loss = towers.sigmoid_cross_entropy(logits, np.ones(64, np.int32))
"""

from sparseflow._model import sigmoid_cross_entropy
from sparseflow.towers._dcn_v2 import DcnV2
from sparseflow.towers._dlrm import Dlrm
from sparseflow.towers._from_config import from_config
from sparseflow.towers._two_tower import TwoTower, in_batch_softmax_loss

__all__ = [
    "DcnV2",
    "Dlrm",
    "TwoTower",
    "from_config",
    "in_batch_softmax_loss",
    "sigmoid_cross_entropy",
]
