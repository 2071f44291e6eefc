"""The served forward as a TensorFlow SavedModel (`jax2tf`), for TF Serving.

The tables are the module's variables; the signature `serving_default` takes,
per feature `f`, `f_ids: int32[batch, length]` and `f_weights:
float32[batch, length]` (padding: id 0, weight 0), and `dense:
float32[batch, num_dense_features]`, and returns `{"logits": float32[batch]}`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import tensorflow as tf
from jax.experimental import jax2tf


def write_saved_model(
    path: Path,
    forward: Callable,
    tables: Mapping[str, np.ndarray],
    features: Sequence[str],
    num_dense: int,
) -> None:
    """Saves `forward` (`sparseflow._export.Forward`) with `tables` to `path`."""
    ragged = {f: f"(b, l{i})" for i, f in enumerate(features)}
    converted = jax2tf.convert(
        forward, polymorphic_shapes=[None, ragged, ragged, f"(b, {num_dense})"]
    )
    module = tf.Module()
    module.tables = {
        name: tf.Variable(values, trainable=False, name=name) for name, values in tables.items()
    }

    def serve(**inputs):
        ids = {f: inputs[f"{f}_ids"] for f in features}
        weights = {f: inputs[f"{f}_weights"] for f in features}
        return {"logits": converted(dict(module.tables), ids, weights, inputs["dense"])}

    specs = {"dense": tf.TensorSpec([None, num_dense], tf.float32, name="dense")}
    for f in features:
        specs[f"{f}_ids"] = tf.TensorSpec([None, None], tf.int32, name=f"{f}_ids")
        specs[f"{f}_weights"] = tf.TensorSpec([None, None], tf.float32, name=f"{f}_weights")
    module.serve = tf.function(serve, autograph=False)
    signature = module.serve.get_concrete_function(**specs)
    tf.saved_model.save(module, str(path), signatures={"serving_default": signature})
