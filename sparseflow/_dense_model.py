"""The dense part of the recommender that the trainer's dense stage runs.

Every dense model is a Flax NNX module over the public `embedding.nnx.Embed`
layer, run through `sparseflow._nnx_model.NnxModel`: the shipped towers
(`model.tower`: `sparseflow.towers.Dlrm` or `DcnV2`, built as
`towers.from_config` builds them) and a user's model (`model.module`) alike.
It gives `init(key)`, the dense parameters (an `nnx.State`);
`forward(params, dense, activations)`, the outputs (logits `float32[batch]`)
of `dense: float32[batch, num_dense]` and per-feature activations
`float32[batch, dim]`; `loss(outputs, labels)`, `float32[]`; and
`per_example_logits`, whether the outputs are logits `float[batch]` that the
trainer's AUC scores (a user's model with a loss of its own may return others).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from sparseflow._errors import UsageError
from sparseflow.config._run_config import RunConfig


def dense_model(
    config: RunConfig,
    mesh: Mesh,
    *,
    model_class: type | None = None,
    loss: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
) -> Any:
    """The run's dense model, an `NnxModel` (`sparseflow._nnx_model`).

    Args:
      config: the run config; its `model` section chooses the model, over
        its feature specs.
      mesh: the run's mesh.
      model_class: a Flax NNX model class in place of `model.module`'s.
      loss: in place of the mean sigmoid cross-entropy (or of a user's model
        class's own `loss`).

    Raises:
      UsageError: the model is one the trainer cannot run.
    """
    # Flax is imported when a run builds its model, not with the trainer:
    # the commands' parsing and help start without it.
    nnx_model = importlib.import_module("sparseflow._nnx_model")
    shipped = config.model.module is None and model_class is None
    if shipped:
        from_config = importlib.import_module("sparseflow.towers._from_config")
        module, args = from_config.tower_class_and_args(config.model)
    elif config.model.pipeshard is not None:
        raise UsageError(
            "model.pipeshard runs the shipped towers (model.tower) only: it cuts the tower "
            "into stages at the pipeline boundaries that sparseflow._model.forward marks "
            "after every layer, which a model of your own does not mark. Drop "
            "model.pipeshard, or train model.tower without model.module."
        )
    else:
        module = config.model.module if model_class is None else model_class
        args = config.model.args
    return nnx_model.NnxModel.create(
        module,
        args,
        config.feature_specs,
        mesh,
        num_sc_per_device=config.mesh.partitions_per_device,
        num_dense_features=config.layout.num_dense_features,
        global_batch_size=config.global_batch_size,
        loss=loss,
        checked=not shipped,
    )


def abstract_outputs(
    dense_model, feature_dims: Mapping[str, int], num_dense_features: int, batch: int
) -> Any:
    """The shapes and dtypes of `dense_model`'s outputs on a batch of `batch` examples.

    Args:
      dense_model: an `NnxModel`.
      feature_dims: each feature's activation width.
      num_dense_features: the width of `dense`.
      batch: examples in the batch.
    """
    params = jax.eval_shape(dense_model.init, jax.random.key(0))
    activations = {
        name: jax.ShapeDtypeStruct((batch, dim), jnp.float32) for name, dim in feature_dims.items()
    }
    dense = jax.ShapeDtypeStruct((batch, num_dense_features), jnp.float32)
    return jax.eval_shape(dense_model.forward, params, dense, activations)


def is_float(value: Any, shape: tuple[int, ...]) -> bool:
    """Whether `value` is a float array (or its shape and dtype) of `shape`."""
    return getattr(value, "shape", None) == shape and jnp.issubdtype(value.dtype, jnp.floating)


def describe(value: Any) -> str:
    """`float32[8, 8]` for an array, the pytree's structure otherwise."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{value.dtype}{list(value.shape)}"
    return str(jax.tree.map(describe, value))


def check_scalar_function(function, outputs: Any, batch: int, what: str) -> None:
    """Checks that `function(outputs, labels: int32[batch])` gives a float scalar.

    Args:
      function: a loss or a metric.
      outputs: the model's outputs on a batch of `batch` examples, abstract.
      batch: the batch's examples.
      what: names `function` at the start of the messages.

    Raises:
      UsageError: it fails on these shapes, or returns anything else.
    """
    labels = jax.ShapeDtypeStruct((batch,), jnp.int32)
    try:
        value = jax.eval_shape(function, outputs, labels)
    except Exception as error:  # a user's function may raise anything on these shapes
        raise UsageError(
            f"{what} failed on outputs {describe(outputs)} and labels int32[{batch}]: {error}"
        ) from error
    if not is_float(value, ()):
        raise UsageError(
            f"{what} must return a float scalar, got {describe(value)} (outputs "
            f"{describe(outputs)})."
        )
