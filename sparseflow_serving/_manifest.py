"""The export folder's layout: the names `sparseflow export` writes and the loader reads.

manifest.json        what is where: the tables (file, shape), every feature
                     (table, combiner, record keys, weights, bytes ids'
                     hashing), the dense inputs, the program's files
tables/<table>.npy   float32[vocabulary_size, dim], rows in vocabulary order
dense_params.npz     the dense parameters, by their path in the parameter tree
forward.jax          the forward, `jax.export`-serialized:
                     (tables, ids, weights, dense) -> float32[batch]
saved_model/         the same forward as a TensorFlow SavedModel (jax2tf)
"""

from __future__ import annotations

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
TABLES_DIR = "tables"
DENSE_PARAMS_NAME = "dense_params.npz"
FORWARD_NAME = "forward.jax"
SAVED_MODEL_DIR = "saved_model"
ITEMS_DIR = "items"
ITEM_IDS = "items/ids.npy"
ITEM_VECTORS = "items/vectors.npy"
