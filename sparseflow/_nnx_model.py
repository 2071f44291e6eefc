"""A Flax NNX model as the trainer's dense model: a shipped tower (`model.tower`,
`sparseflow.towers`) or a user's (`model.module` in the config).

The model is built around an `embedding.nnx.Embed` layer that the trainer
hands it: `Class(embed, num_dense_features, rngs=rngs, **model.args)` (a
shipped tower's arguments come from the config's widths), and
called as `model(sparse_batch, dense)` it returns logits `float32[batch]`,
trained with the mean sigmoid cross-entropy; or, when the class defines a
`loss(outputs, labels)` (or the trainer is given a loss), any outputs that
loss takes (a retrieval model's `float32[batch, batch]` in-batch logits,
say): the trainer then reports no AUC, which needs per-example logits.
The trainer's own sparse stages look the batch up in the run's tables and
update them; the dense stage runs the model with the layer given those activations
(`embedding.nnx.provided_activations`), differentiating its `nnx.Param`s
(the dense parameters, kept in `TrainState.params` as an `nnx.State`) and
the activations. The layer's own tables are never materialized here: the
model is built abstractly (`nnx.eval_shape`), and its dense parameters by a
compiled program of their initializers alone (the layer in it stays abstract).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

import embedding
from embedding import nnx as enx
from sparseflow._dense_model import abstract_outputs, check_scalar_function, describe, is_float
from sparseflow._errors import UsageError
from sparseflow._model import sigmoid_cross_entropy

# What the trainer holds apart from the model's dense parameters.
_EMBEDDING = (enx.EmbeddingParam, enx.EmbeddingStep)


def load_model_class(module: str | type) -> type:
    """The class `model.module` names (`"package.module:Class"`), or `module` itself.

    Raises:
      UsageError: the module does not import, has no such attribute, or
        it is not an NNX module class.
    """
    if isinstance(module, type):
        if not issubclass(module, nnx.Module):
            raise UsageError(f"The model {module.__qualname__} is not a flax.nnx.Module class.")
        return module
    module_name, _, name = module.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except ImportError as error:
        raise UsageError(
            f"model.module {module!r}: cannot import {module_name!r}: {error}. Install the "
            "package, or run from the folder that holds it."
        ) from error
    except AttributeError:
        raise UsageError(f"model.module {module!r}: {module_name} has no {name!r}.") from None
    if not isinstance(found, type) or not issubclass(found, nnx.Module):
        raise UsageError(f"model.module {module!r} is not a flax.nnx.Module class.")
    return found


@dataclasses.dataclass(frozen=True, eq=False)
class NnxModel:
    """The dense part of an NNX model, for the trainer's stages.

    Attributes:
      name: `model.module` (`"package.module:Class"`), for messages.
      build: `(key) -> model`: the model over the run's abstract `Embed`
        layer (its tables and slots shapes and dtypes only), built once.
      loss: `(outputs, labels) -> float32[]`.
      graphdef: the model's graph.
      embedding_state: the layer's tables, slots and step, abstract (never read).
      layer_path: where the layer sits in the model (`embed_layers`).
      per_example_logits: the model's outputs are logits `float[batch]`, which
        the trainer's AUC scores; False for other outputs (no AUC).
      mean_over_examples: the loss is the mean over the batch of one term per
        example, of outputs that depend on that example alone: the loss and
        gradients of a batch are then the mean of those of its equal parts,
        which the dense stage computes one part per device
        (`sparseflow._steps.Stages`). The model class says so (a class
        attribute `mean_over_examples = True`, as the shipped towers have) of
        its own loss; a loss given in place of it leaves this False. A batch
        statistic or an in-batch softmax breaks it.
    """

    name: str
    build: Any
    graphdef: Any
    embedding_state: Any
    layer_path: str
    loss: Any
    per_example_logits: bool = True
    mean_over_examples: bool = False

    @classmethod
    def create(
        cls,
        module: str | type,
        args: Mapping[str, Any],
        feature_specs: Mapping[str, embedding.FeatureSpec],
        mesh: Mesh,
        *,
        num_sc_per_device: int,
        num_dense_features: int,
        global_batch_size: int,
        loss: Any = None,
        checked: bool = True,
    ) -> NnxModel:
        """Builds `module`'s class (or `module`, a class) abstractly and checks it is a
        model the trainer runs.

        The loss `(outputs, labels: int32[batch]) -> float32[]` that trains it is
        `loss`, else the class's own `loss` (a static method or function
        attribute), else the mean sigmoid cross-entropy of logits `float[batch]`.
        Without `checked` (a shipped tower, whose outputs are known) its outputs
        are not traced against the loss, which a run's start would wait for.

        Raises:
          UsageError: the class does not import or build with `args`, does not
            hold the `Embed` layer it was given (or holds others), holds
            variables other than `nnx.Param`s beside the layer's; with the
            default loss, does not return `float[global_batch_size]` logits;
            with another, its outputs do not give that loss a float scalar.
        """
        model_class = load_model_class(module)
        if not isinstance(module, str):
            module = f"{model_class.__module__}:{model_class.__qualname__}"

        # The layer abstract, built once: the trainer holds the tables, and
        # tracing their initializers (26 tables of the Criteo config) made up
        # most of a run's set-up, although XLA dropped them from the program.
        embed = nnx.eval_shape(
            lambda: enx.Embed(
                feature_specs, mesh, num_sc_per_device=num_sc_per_device, rngs=nnx.Rngs(0)
            )
        )

        def build(key: jax.Array) -> nnx.Module:
            try:
                model = model_class(embed, num_dense_features, rngs=nnx.Rngs(key), **args)
            except TypeError as error:
                raise UsageError(
                    f"model.module {module!r}: {model_class.__name__}(embed, "
                    f"num_dense_features, rngs=..., **model.args) failed: {error}. It must take "
                    "the Embed layer, the number of dense features and rngs, and model.args "
                    f"({sorted(args)}) as keywords."
                ) from error
            layers = enx.embed_layers(model) if _holds_embed(model) else {}
            if list(layers.values()) != [embed]:
                raise UsageError(
                    f"model.module {module!r}: the model must hold the Embed layer it is given, "
                    f"and no other; it holds {len(layers)} Embed layer(s)"
                    + ("" if embed in layers.values() else ", none of them the one given")
                    + "."
                )
            return model

        abstract = nnx.eval_shape(lambda: build(jax.random.key(0)))
        graphdef, embedding_state, _, rest = nnx.split(abstract, _EMBEDDING, nnx.Param, ...)
        if jax.tree.leaves(rest):
            kinds = sorted({type(v).__name__ for _, v in nnx.iter_graph(abstract) if _is_other(v)})
            raise UsageError(
                f"model.module {module!r} holds variables of type {', '.join(kinds)}; the "
                "trainer carries the Embed layer's and nnx.Params only."
            )
        (layer_path,) = enx.embed_layers(abstract)
        mean_over_examples = loss is None and getattr(model_class, "mean_over_examples", False)
        if mean_over_examples is not True and mean_over_examples is not False:
            raise UsageError(
                f"model.module {module!r}: its mean_over_examples must be True or False, got "
                f"{mean_over_examples!r}."
            )
        if loss is None:
            loss = getattr(model_class, "loss", None) or sigmoid_cross_entropy
        model = cls(
            module,
            build,
            graphdef,
            embedding_state,
            layer_path,
            loss,
            mean_over_examples=mean_over_examples,
        )
        if not checked:
            return model
        outputs = abstract_outputs(
            model, embedding.feature_dims(feature_specs), num_dense_features, global_batch_size
        )
        if loss is sigmoid_cross_entropy:
            model._check_logits(outputs, global_batch_size)
            return model
        check_scalar_function(
            loss, outputs, global_batch_size, f"model.module {module!r}: its loss(outputs, labels)"
        )
        per_example = is_float(outputs, (global_batch_size,))
        return dataclasses.replace(model, per_example_logits=per_example)

    def init(self, key: jax.Array) -> nnx.State:
        """The model's dense parameters (`nnx.Param`s), as built from `key`."""
        return nnx.split(self.build(key), _EMBEDDING, nnx.Param)[2]

    def forward(
        self, params: nnx.State, dense: jax.Array, activations: Mapping[str, jax.Array]
    ) -> Any:
        """The model's outputs (logits `float32[batch]` for the default loss) on
        `activations` (per feature, as the layer's lookup gives them) and
        `dense: float32[batch, num_dense]`."""
        model = self.merged(params)
        layer = enx.embed_layers(model)[self.layer_path]
        with enx.provided_activations({layer: dict(activations)}):
            return model(None, dense)

    def merged(self, params: nnx.State) -> nnx.Module:
        """The model holding `params` (its `Embed` layer abstract)."""
        return nnx.merge(self.graphdef, self.embedding_state, params)

    def _check_logits(self, outputs: Any, batch: int) -> None:
        if not is_float(outputs, (batch,)):
            raise UsageError(
                f"model.module {self.name!r}: model(sparse_batch, dense) must return logits "
                f"float[batch] (float32[{batch}] for this config), got {describe(outputs)}; "
                "a model with other outputs defines the loss that takes them "
                "(`loss(outputs, labels)`, a static method of the class)."
            )


def _holds_embed(model: Any) -> bool:
    return any(isinstance(v, enx.Embed) for _, v in nnx.iter_graph(model))


def _is_other(value: Any) -> bool:
    return isinstance(value, nnx.Variable) and not isinstance(value, (*_EMBEDDING, nnx.Param))
