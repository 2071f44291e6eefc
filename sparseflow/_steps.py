"""The recommender's training stages: sparse lookup, dense tower, sparse update.

The three stage functions follow `parallel`'s stage protocols, so the same
functions serve the pipelined step (`parallel.step`) and the sequential one.
Their sparse inputs are a batch's packed layout (`pipelines.PackedInput`),
unpacked inside the step.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, PartitionSpec

import embedding
import parallel
from parallel import pipeshard
from sparseflow._tower_config import PipeshardConfig

# XLA's options for a program that runs once at a run's start: its compilation,
# not its run, is what the start waits for (docs/benchmarks.md).
_RUN_ONCE = {"xla_backend_optimization_level": 0}


def _usable_cores() -> int:
    """The cores this process may run on (its affinity, where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class TrainState(NamedTuple):
    """The dense side of training.

    Attributes:
      params: the dense model's parameters (`dense_model.init`'s `nnx.State`).
      opt_state: their optimizer state.
      step: `int32[]`, dense updates applied so far.
    """

    params: Any
    opt_state: optax.OptState
    step: jax.Array


class DenseInputs(NamedTuple):
    """`dense: float32[batch, num_dense]`, `labels: int32[batch]`."""

    dense: jax.Array
    labels: jax.Array


class StepOutput(NamedTuple):
    """`loss: float32[]`, `logits: float32[batch]`, `labels: int32[batch]` of one batch.

    `logits` is zeros when the model's outputs are not per-example logits
    (`dense_model.per_example_logits`): they have no AUC, and the pipeline
    state, which holds a placeholder of the output, stays small (not
    `[batch, batch]`) and saves (orbax refuses an array of size 0).
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
      pipeshard: run the dense tower as a pipeshard pipeline (`pipeshard_tc`).
      dense_model: the dense stage's model (`_dense_model.dense_model`): its
        `forward(params, dense, activations)` gives the outputs its `loss` takes.
    """

    feature_specs: Mapping[str, embedding.FeatureSpec]
    mesh: Mesh
    optimizer: optax.GradientTransformation
    enable_minibatching: bool
    pipeshard: PipeshardConfig | None = None
    dense_model: Any = None

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
        return dict(sorted(embedding.feature_dims(self.feature_specs).items()))

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
        grad_fn = jax.value_and_grad(self._loss, argnums=(0, 2), has_aux=True)
        if self.mesh.size > 1 and self.dense_model.mean_over_examples:
            grad_fn = _mean_of_device_parts(grad_fn, self.mesh)
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

    def _loss(self, params, dense: jax.Array, activations, labels: jax.Array):
        """`(loss, logits)` of the dense model on a batch (`StepOutput.logits`)."""
        outputs = self.dense_model.forward(params, dense, activations)
        loss = self.dense_model.loss(outputs, labels)
        if not self.dense_model.per_example_logits:
            outputs = jnp.zeros(labels.shape, jnp.float32)
        return loss, outputs

    def pipeshard_loss(self, params, activations, dense_inputs: DenseInputs) -> jax.Array:
        """The loss of the dense model on a batch, as `parallel.pipeshard` takes it."""
        return self._loss(params, dense_inputs.dense, activations, dense_inputs.labels)[0]

    @functools.cached_property
    def pipeshard_tc(self) -> PipeshardTc:
        """The TC stage with the tower as a pipeshard pipeline, driven from the host."""
        if self.pipeshard is None:
            raise ValueError("The config has no model.pipeshard section.")
        return PipeshardTc(self, self.pipeshard)

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

        return jax.jit(step, donate_argnums=(0, 1), compiler_options=self.step_compiler_options)

    @functools.cached_property
    def step_compiler_options(self) -> dict[str, Any] | None:
        """XLA's options for the training step's program on `mesh`.

        Where this process's CPU devices outnumber the cores it may run on,
        XLA runs every device's program at once, and a scheduler that orders
        each program for independent operations side by side
        (`xla_cpu_enable_concurrency_optimized_scheduler`) only adds work
        that waits for a core: off there, on by XLA's default elsewhere
        (docs/benchmarks.md).
        """
        local = self.mesh.local_devices
        if local[0].platform != "cpu" or len(local) <= _usable_cores():
            return None
        return {"xla_cpu_enable_concurrency_optimized_scheduler": False}

    @functools.cached_property
    def eval_logits(self):
        """`(params, tables, sparse, dense) -> float32[batch]` logits, jitted."""

        def logits(params, tables, sparse_inputs, dense_inputs):
            activations, _ = self.sc_fwd(sparse_inputs, tables)
            return self.dense_model.forward(params, dense_inputs.dense, self.unstack(activations))

        return jax.jit(logits)


class PipeshardTc:
    """`Stages.tc` with the dense tower run as a pipeshard pipeline.

    The tower's forward and backward run on `config.stages` device groups
    with `config.microbatches` microbatches in the configured schedule
    (`parallel.pipeshard.pipeshard_tc_function`), then the dense optimizer
    updates on the whole mesh. It is driven from the host, so the training
    loop runs it with `parallel.host_driven_step`; traced, it raises
    `pipeshard.HostDrivenStageError`. The logits for the AUC come from one
    more compiled forward pass of the batch. Results equal `Stages.tc`'s up
    to the order of the microbatch sums. The stages are cut at the pipeline
    boundaries that `sparseflow._model.forward` marks, so the dense model is
    a shipped tower (`sparseflow.towers`).

    Attributes:
      shape_function: `Stages.tc`, which has the same outputs, for
        `parallel.get_initial_state`.
      stage: the pipeshard TC stage (its `pipeshard_function.last_schedule`
        is the last batch's executed schedule).
    """

    def __init__(self, stages: Stages, config: PipeshardConfig):
        self._stages, self._config = stages, config
        self.shape_function = stages.tc
        self._unstack = jax.jit(stages.unstack)
        self._stack = jax.jit(stages.stack)
        self._logits = jax.jit(stages.dense_model.forward)
        self.stage: pipeshard.PipeshardTcStage | None = None

    def method(self, num_layers: int) -> pipeshard.PipeshardParallel:
        """The pipeline options for a tower of `num_layers` layers.

        Raises:
          ValueError: more stages (times virtual stages) than the tower has
            layers, or more stages than devices.
        """
        config, devices = self._config, self._stages.mesh.size
        chunks = config.stages * config.virtual_stages
        if config.stages > devices:
            raise ValueError(
                f"model.pipeshard.stages={config.stages} but the mesh has {devices} devices; "
                f"use at most {devices} stages."
            )
        base, extra = divmod(devices, config.stages)
        counts = tuple(base + (g < extra) for g in range(config.stages))
        if config.layers == "auto":
            layer_option = pipeshard.AutoLayerOption(layer_num=chunks)
            stage_option = pipeshard.UniformStageOption(num_stages=config.stages)
        else:
            if chunks > num_layers:
                raise ValueError(
                    f"model.pipeshard asks for {chunks} stages (stages x virtual_stages) but "
                    f"the tower has {num_layers} layers; use fewer stages, a deeper tower, or "
                    "layers: auto."
                )
            size, more = divmod(num_layers, chunks)
            bounds = np.cumsum([0] + [size + (c < more) for c in range(chunks)])
            layer_option = "manual"
            stage_option = pipeshard.ManualStageOption(
                forward_stage_layer_ids=tuple(
                    tuple(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)
                ),
                submesh_device_counts=counts,
            )
        return pipeshard.PipeshardParallel(
            num_micro_batches=config.microbatches,
            layer_option=layer_option,
            stage_option=stage_option,
            pipeline_schedule=config.schedule,
            virtual_stages=config.virtual_stages,
        )

    def __call__(self, activations, dense_inputs: DenseInputs, state: TrainState, sc_fwd_aux):
        if self.stage is None:
            tower = self._stages.dense_model.merged(state.params)
            self.stage = pipeshard.pipeshard_tc_function(
                self._stages.pipeshard_loss,
                self._stages.optimizer,
                method=self.method(tower.num_layers()),
                devices=self._stages.mesh.devices.flat,
            )
        per_feature = self._unstack(activations)
        grads, loss, new_state, step = self.stage(
            per_feature, dense_inputs, pipeshard.TcTrainState(*state)
        )
        logits = self._logits(state.params, dense_inputs.dense, per_feature)
        return (
            self._stack(grads),
            StepOutput(loss, logits, dense_inputs.labels),
            TrainState(*new_state),
            (step, sc_fwd_aux),
        )


def _mean_of_device_parts(value_and_grad, mesh: Mesh):
    """`value_and_grad(params, dense, activations, labels)` of a loss that is a
    mean over examples (`NnxModel.mean_over_examples`), computed on each
    device's equal part of the batch and averaged: `((loss, outputs),
    (param_grads, activation_grads))` as of the whole batch.

    The loss and the parameters' gradients are summed in one all-reduce of
    one flat array. Partitioned by XLA instead, each gradient is summed in an
    array of its own, and XLA:CPU runs one rendezvous of every device per
    array of an all-reduce (11 for the Criteo DLRM): where devices share the
    cores, each one costs a wait and a wake-up per device (docs/benchmarks.md).
    """
    axis = mesh.axis_names[0]
    sharded, replicated = PartitionSpec(axis), PartitionSpec()

    def on_device(params, dense, activations, labels):
        (loss, outputs), (param_grads, activation_grads) = value_and_grad(
            params, dense, activations, labels
        )
        flat, unravel = ravel_pytree((loss, param_grads))
        loss, param_grads = unravel(jax.lax.pmean(flat, axis))
        # An example's term weighs 1/size as much in the batch's mean as in its part's.
        activation_grads = jax.tree.map(lambda g: g / mesh.size, activation_grads)
        return (loss, outputs), (param_grads, activation_grads)

    return jax.shard_map(
        on_device,
        mesh=mesh,
        in_specs=(replicated, sharded, sharded, sharded),
        out_specs=((replicated, sharded), (replicated, sharded)),
        # Unchecked, a replicated parameter's gradient is this device's part, for
        # the one psum to sum; checked, JAX's transpose would sum each itself.
        check_vma=False,
    )


def initial_train_state(
    key: jax.Array, dense_model: Any, optimizer: optax.GradientTransformation
) -> TrainState:
    """The dense parameters (`dense_model.init`), their optimizer state and step 0,
    traced (`init_train_state` compiles and runs it; `jax.eval_shape` of it gives
    the shapes)."""
    params = dense_model.init(key)
    return TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32))


def init_train_state(
    key: jax.Array, dense_model: Any, optimizer: optax.GradientTransformation, mesh: Mesh
) -> TrainState:
    """`initial_train_state` as one compiled program, on every device of `mesh`.

    Run op by op, the initializers and the optimizer's zeros compiled a
    program each. It runs once, so XLA compiles it without its backend
    optimizations. Every device computes the whole state: put there from one
    device, a run of several processes would first check that the processes
    hold the same values, one collective per array (docs/benchmarks.md).
    """
    init = functools.partial(initial_train_state, dense_model=dense_model, optimizer=optimizer)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(init, out_shardings=replicated, compiler_options=_RUN_ONCE)(key)
