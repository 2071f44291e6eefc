"""Serving a model `sparseflow export` wrote, with numpy and JAX only.

This package imports none of sparseflow's others, nor Grain, Beam,
TensorFlow or Orbax: a serving process loads the export folder's tables and
its serialized forward (`jax.export`) and scores raw ids.

    model = sparseflow_serving.load_exported("export/")
    logits = model.score({"user_id": [[12], [7]], ...}, dense=np.zeros((2, 13)))
"""

from sparseflow_serving._loader import ExportedModel, load_exported
from sparseflow_serving._manifest import FORMAT_VERSION, MANIFEST_NAME

__all__ = ["FORMAT_VERSION", "MANIFEST_NAME", "ExportedModel", "load_exported"]
