"""The recommender's training stages: sparse lookup, dense tower, sparse update.

The three stage functions follow `parallel`'s stage protocols, so the same
functions serve the pipelined step (`parallel.step`) and the sequential one.
Their sparse inputs are a batch's packed layout (`pipelines.PackedInput`),
unpacked inside the step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

import embedding
import parallel
from sparseflow import _model


class TrainState(NamedTuple):
    """The dense side of training.

    Attributes:
      params: the dense tower's parameters.
      opt_state: their optimizer state.
      step: `int32[]`, dense updates applied so far.
    """

    params: _model.Params
    opt_state: optax.OptState
    step: jax.Array


class DenseInputs(NamedTuple):
    """`dense: float32[batch, num_dense]`, `labels: int32[batch]`."""

    dense: jax.Array
    labels: jax.Array


class StepOutput(NamedTuple):
    """`loss: float32[]`, `logits: float32[batch]`, `labels: int32[batch]` of one batch.

    The labels travel with the output because a pipelined step returns the
    output of the previous call's batch.
    """

    loss: jax.Array
    logits: jax.Array
    labels: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class Stages:
    """The stage functions of one run (hashable by identity: static for jit).

    Attributes:
      feature_specs: the run's prepared feature specs.
      mesh: the 1-D mesh of all devices.
      optimizer: the dense optimizer.
      enable_minibatching: as given to the preprocessing.
    """

    feature_specs: Mapping[str, embedding.FeatureSpec]
    mesh: Mesh
    optimizer: optax.GradientTransformation
    enable_minibatching: bool

    def sc_fwd(self, sparse_inputs, embedding_variables):
        """Lookup: `(float32[batch, sum of dims] stacked activations, LayoutIndex)`.

        The activations leave the stage stacked (`stack`), and the index
        travels with the batch to its update (through `tc_aux`), which then
        does not read the layout again: in a pipelined step the update and
        the lookup see different batches, so XLA cannot share that work
        between them as it does in the sequential step.
        """
        activations, index = embedding.sparse_dense_matmul(
            sparse_inputs.unpack(),
            embedding_variables,
            self.feature_specs,
            self.mesh,
            enable_minibatching=self.enable_minibatching,
            return_layout_index=True,
        )
        return self.stack(activations), index

    @functools.cached_property
    def feature_dims(self) -> dict[str, int]:
        """The embedding dim of every feature, in name order (the stacking order)."""
        return {
            name: self.feature_specs[name].table_spec.embedding_dim
            for name in sorted(self.feature_specs)
        }

    def stack(self, per_feature: Mapping[str, jax.Array]) -> jax.Array:
        """`float32[batch, sum of dims]`: per-feature `float32[batch, dim]`
        arrays side by side, in name order.

        The pipeline state holds a batch's activations and gradients from one
        step to the next; as one array each they cost one buffer per device
        instead of one per feature, on every call.
        """
        return jnp.concatenate([per_feature[name] for name in self.feature_dims], axis=1)

    def unstack(self, stacked: jax.Array) -> dict[str, jax.Array]:
        """The inverse of `stack`."""
        splits = np.cumsum(list(self.feature_dims.values()))[:-1]
        return dict(zip(self.feature_dims, jnp.split(stacked, splits, axis=1), strict=True))

    @functools.cached_property
    def tc(self):
        """The TC stage on stacked activations and gradients (`tc_per_feature` inside)."""
        return parallel.unstacked_tc_function(
            self.tc_per_feature, unstack_activations=self.unstack, stack_gradients=self.stack
        )

    def tc_per_feature(self, activations, dense_inputs: DenseInputs, state: TrainState, sc_fwd_aux):
        """Dense forward/backward and update.

        `tc_aux` is `(step, layout_index)`: the batch's training step and
        the `sc_fwd_aux` of the same batch, for its embedding update.
        """
        grad_fn = jax.value_and_grad(_model.loss_fn, argnums=(0, 2), has_aux=True)
        (loss, logits), (param_grads, activation_grads) = grad_fn(
            state.params, dense_inputs.dense, activations, dense_inputs.labels
        )
        updates, opt_state = self.optimizer.update(param_grads, state.opt_state, state.params)
        new_state = TrainState(
            optax.apply_updates(state.params, updates), opt_state, state.step + 1
        )
        return (
            activation_grads,
            StepOutput(loss, logits, dense_inputs.labels),
            new_state,
            (state.step, sc_fwd_aux),
        )

    def sc_bwd(self, sparse_inputs, activation_grads, embedding_variables, tc_aux):
        """Update from stacked activation gradients."""
        step, layout_index = tc_aux
        tables = embedding.apply_gradients(
            self.unstack(activation_grads),
            sparse_inputs.unpack(),
            embedding_variables,
            self.feature_specs,
            self.mesh,
            step,
            enable_minibatching=self.enable_minibatching,
            layout_index=layout_index,
        )
        return tables, None

    @functools.cached_property
    def sequential_step(self):
        """`(state, tables, sparse, dense) -> (state, tables, StepOutput)`, jitted.

        Lookup, dense step and update of one batch, in order (no delay).
        """

        def step(state, tables, sparse_inputs, dense_inputs):
            activations, sc_fwd_aux = self.sc_fwd(sparse_inputs, tables)
            grads, output, state_out, tc_aux = self.tc(activations, dense_inputs, state, sc_fwd_aux)
            tables, _ = self.sc_bwd(sparse_inputs, grads, tables, tc_aux)
            return state_out, tables, output

        return jax.jit(step, donate_argnums=(0, 1))

    @functools.cached_property
    def eval_logits(self):
        """`(params, tables, sparse, dense) -> float32[batch]` logits, jitted."""

        def logits(params, tables, sparse_inputs, dense_inputs):
            activations, _ = self.sc_fwd(sparse_inputs, tables)
            return _model.forward(params, dense_inputs.dense, self.unstack(activations))

        return jax.jit(logits)


def init_train_state(
    key: jax.Array,
    model: _model.ModelConfig,
    num_dense: int,
    feature_dims: Mapping[str, int],
    optimizer: optax.GradientTransformation,
) -> TrainState:
    params = _model.init_params(key, model, num_dense, feature_dims)
    return TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32))


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Places a pytree on every device of `mesh` (the dense state)."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.device_put(tree, sharding)
