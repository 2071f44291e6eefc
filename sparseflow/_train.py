"""The training program: Grain batches -> sharded lookup -> dense tower -> update.

One process per host; every process runs this same loop (under
`jax.distributed` when there are several). Each step blocks on its outputs
before the next is dispatched: on XLA:CPU two programs with collectives in
flight at once deadlock.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import gc
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import embedding
import parallel
import pipelines
from parallel import allreduce
from sparseflow import (
    _dense_model,
    _eval_metrics,
    _hosts,
    _in_flight,
    _limit_feedback,
    _mesh_change,
    _model,
    _run_identity,
)
from sparseflow._checkpoint import Checkpoints, Snapshot, check_fresh
from sparseflow._dict_params import reading_dict_params
from sparseflow._errors import UsageError
from sparseflow._metrics import MetricsWriter, Progress
from sparseflow._steps import (
    DenseInputs,
    Stages,
    TrainState,
    init_train_state,
    initial_train_state,
)
from sparseflow.config._run_config import RunConfig

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """One `sparseflow train` invocation (the config holds the rest).

    Attributes:
      data: training ArrayRecord files, directories or globs.
      eval_data: held-out data evaluated at the end, or None.
      steps: overrides `training.steps`.
      pipelined: overrides `training.pipelined`.
      fdo_dir: FDO stats to set the tables' limits from, or None.
      checkpoint_dir: where checkpoints go, or None for none. Without
        `resume` it must be empty or missing.
      resume: continue from the newest checkpoint in `checkpoint_dir`, which
        must have been written by this run (same layout config and data; the
        device count and partitions per device may differ, `_mesh_change`).
      metrics_dir: TensorBoard event files, or None.
      stop_after: end the process abruptly after this many steps (after the
        step's checkpoint, if one is due): what a crash leaves, for resume tests.
      progress: show a progress bar.
      agreement_port: overrides `training.agreement_port` (0: keep it).
      agreement_hosts: the hosts' addresses in process order, for the
        minibatching agreement (default: all 127.0.0.1, local processes).
      model: a Flax NNX model class to train in place of `model.module`'s
        (`sparseflow.Trainer`); the config's `model.args` are its arguments.
      loss: `(outputs, labels) -> float32[]` in place of the mean sigmoid
        cross-entropy of logits (or of a user's model class's own `loss`).
      metrics: `{name: (outputs, labels) -> float[]}`, each reported as its
        mean over the evaluation's batches (`sparseflow._eval_metrics`).
      input_timeout_s: the longest the loop waits for a batch before it
        stops with `pipelines.InputTimeoutError`; a Grain worker that dies
        stops it at once (`pipelines.InputWorkerError`).
    """

    data: str | Sequence[str]
    eval_data: str | Sequence[str] | None = None
    steps: int | None = None
    pipelined: bool | None = None
    fdo_dir: Path | None = None
    checkpoint_dir: Path | None = None
    resume: bool = False
    metrics_dir: Path | None = None
    stop_after: int | None = None
    progress: bool = True
    agreement_port: int = 0
    agreement_hosts: Sequence[str] | None = None
    input_timeout_s: float = pipelines.DEFAULT_INPUT_TIMEOUT_S
    model: type | None = None
    loss: Callable[[Any, Any], Any] | None = None
    metrics: Mapping[str, Callable[[Any, Any], Any]] | None = None


class TrainingDivergedError(embedding.SparseflowError, ValueError):
    """The loss or the parameters stopped being finite; nothing from that step on is saved."""


class TrainResult(NamedTuple):
    """What a run did.

    Attributes:
      steps: batches trained on (in this run and before a resume).
      losses: the loss of every batch, in order.
      train_auc: AUC over the last logged window of training batches; NaN
        when the model's outputs are not per-example logits.
      eval_auc: AUC on `eval_data`, or None (also when the model's outputs
        are not per-example logits).
      eval_metrics: each of the options' `metrics` on `eval_data`: its mean
        over the batches (empty without `eval_data` or metrics).
      examples_per_s: training throughput of this process's run.
      seconds: wall time of the training loop.
      call_seconds: wall time of every step call of this run (pipelined: n + 2
        calls), from dispatch until its outputs are ready.
      input_wait_seconds: for every call of `call_seconds`, the time the loop
        waited for the call's batch before it (0 for the draining calls).
      time_to_first_step: seconds from entering `train` to the end of this
        run's first step call (set-up, input start, compilation).
      train_state: the dense parameters and optimizer state at the end.
      embedding_variables: the tables and slots at the end, by stack.
      limits: the stacks' limits at the end (raised where a batch needed more).
    """

    steps: int
    losses: list[float]
    train_auc: float
    eval_auc: float | None
    eval_metrics: dict[str, float]
    examples_per_s: float
    seconds: float
    call_seconds: list[float]
    input_wait_seconds: list[float]
    time_to_first_step: float
    train_state: Any
    embedding_variables: dict[str, embedding.EmbeddingVariables]
    limits: dict[str, embedding.StackLimits]


def make_mesh(devices: int) -> Mesh:
    """The 1-D mesh over every device of every process, `devices` of them.

    Raises:
      UsageError: JAX shows another number of devices than the config's
        `mesh.devices` (the tables' sharding, the FDO stats and the
        checkpoints all follow the config's).
    """
    if jax.device_count() != devices:
        flags = os.environ.get("XLA_FLAGS", "")
        raise UsageError(
            f"The config's mesh.devices is {devices}, but JAX shows {jax.device_count()} "
            f"devices over {jax.process_count()} process(es)"
            + (f" (XLA_FLAGS={flags!r})" if flags else "")
            + ". On CPU, sparseflow sets the device count from the config unless XLA_FLAGS "
            "already sets --xla_force_host_platform_device_count: unset that flag, or make "
            "mesh.devices the number of devices the run should use."
        )
    return Mesh(np.array(jax.devices()), ("devices",))


def _feature_specs(config: RunConfig, options: TrainOptions, mesh: Mesh):
    specs = embedding.prepare_feature_specs_for_training(
        config.feature_specs, mesh.size, config.mesh.partitions_per_device
    )
    return _limit_feedback.initial_specs(
        specs,
        fdo_dir=options.fdo_dir,
        layout=config.fdo_layout,
        geometry=fdo_geometry(config),
        batching=_batching(config, training=True),
        data=options.data,
        headroom=config.training.fdo_headroom,
    )


def record_layout(config: RunConfig, options: TrainOptions) -> pipelines.FeatureLayout:
    """The config's record layout, its standardized dense keys given the FDO job's moments."""
    schema = config.layout.schema
    if not schema.standardized():
        return config.layout
    if options.fdo_dir is None:
        keys = [column.key for column in schema.standardized()]
        raise ValueError(
            f"the dense keys {keys} are standardized with the mean and std the FDO job "
            "computes: give the FDO output directory (--fdo)"
        )
    moments = pipelines.load_dense_moments(options.fdo_dir)
    return pipelines.FeatureLayout.from_schema(schema.with_moments(moments))


def fdo_geometry(config: RunConfig) -> embedding.FdoGeometry:
    """The batch geometry FDO stats must have been computed for."""
    return embedding.FdoGeometry(
        global_batch_size=config.global_batch_size,
        devices=config.mesh.devices,
        partitions_per_device=config.mesh.partitions_per_device,
        processes=jax.process_count(),
    )


# Ports a host keeps for its workers' agreement groups (worker w: base + w).
AGREEMENT_PORT_STRIDE = 64


def agreement_peers(hosts: Sequence[str], base_port: int) -> list[str]:
    """`host:port` of every host's all-reduce node, in rank order.

    Host r listens on `base_port + 64 * r`, so that local processes standing
    in for hosts (all on 127.0.0.1) do not collide; worker w of a host adds w.
    """
    return [f"{host}:{base_port + AGREEMENT_PORT_STRIDE * r}" for r, host in enumerate(hosts)]


def _agreement(config: RunConfig, options: TrainOptions) -> allreduce.AllReduceConfig | None:
    if jax.process_count() == 1 or not config.preprocessing.enable_minibatching:
        return None
    port = options.agreement_port or config.training.agreement_port
    if not port:
        raise UsageError(
            "Minibatching on several hosts needs training.agreement_port (the first "
            "port of the hosts' all-reduce groups) in the config."
        )
    hosts = options.agreement_hosts or ["127.0.0.1"] * jax.process_count()
    if len(hosts) != jax.process_count():
        raise UsageError(f"{len(hosts)} agreement hosts given for {jax.process_count()} processes.")
    return allreduce.AllReduceConfig(
        rank=jax.process_index(),
        peers=agreement_peers(hosts, port),
        security=config.training.agreement_security(run_id=config.config_hash),
    )


def _preprocess_config(
    config: RunConfig, options: TrainOptions, specs, mesh: Mesh
) -> pipelines.PreprocessConfig:
    pre = config.preprocessing
    return pipelines.PreprocessConfig(
        feature_specs=specs,
        layout=record_layout(config, options),
        local_device_count=mesh.local_mesh.size,
        global_device_count=mesh.size,
        num_sc_per_device=config.mesh.partitions_per_device,
        allow_id_dropping=pre.allow_id_dropping,
        enable_minibatching=pre.enable_minibatching,
        invalid_id_policy=pre.invalid_id_policy,
        on_bad_record=pre.on_bad_record,
        agreement=_agreement(config, options),
    )


def _iterator(
    config: RunConfig, options: TrainOptions, specs, mesh: Mesh, data, *, training: bool
) -> pipelines.DeviceIterator:
    host = pipelines.make_grain_iterator(
        data,
        batching=_batching(config, training=training),
        preprocess=_preprocess_config(config, options, specs, mesh),
        options=pipelines.GrainOptions(
            worker_count=config.training.workers if training else 0,
            worker_priority=config.training.worker_priority,
        ),
    )
    return pipelines.DeviceIterator(host, mesh, timeout_s=options.input_timeout_s)


def _batching(config: RunConfig, *, training: bool) -> pipelines.BatchingConfig:
    shuffle = training and config.training.shuffle
    return pipelines.BatchingConfig(
        global_batch_size=config.global_batch_size,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        num_epochs=config.training.epochs if training else 1,
        shuffle_seed=config.seed if shuffle else None,
    )


def _ranges(indices: np.ndarray, shown: int = 8) -> str:
    """`[0, 1, 2, 7]` as `0-2, 7`: the first `shown` runs of consecutive sorted indices."""
    values = np.sort(indices)
    starts = np.flatnonzero(np.diff(values, prepend=values[0] - 2) != 1)
    ends = np.append(starts[1:], len(values)) - 1
    runs = [
        f"{values[a]}" if a == b else f"{values[a]}-{values[b]}"
        for a, b in zip(starts, ends, strict=True)
    ]
    return ", ".join(runs[:shown]) + (", ..." if len(runs) > shown else "")


def _gathered(x: jax.Array) -> np.ndarray:
    """The full value of a row-sharded global array, on every process."""
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _dense_inputs(batch: pipelines.DeviceBatch) -> DenseInputs:
    return DenseInputs(batch.dense, batch.labels)


@dataclasses.dataclass(frozen=True)
class _Segment:
    """One fill and drain of the pipeline: batches `first_batch..n-1`, in
    `n - first_batch + 2` calls from call `first_call` on.

    A run has one, from 0. A run resumed for more batches from a drained
    pipeline (the end of a shorter run) starts another: a drained state holds
    no batch in flight, as an initial one, and calls numbered on from the old
    segment would run the dense step on its zeros. A sequential run is one
    segment of one call per batch.
    """

    first_batch: int = 0
    first_call: int = 0

    @classmethod
    def of(cls, metadata: dict) -> _Segment:
        """The segment a checkpoint's metadata records (an older one's: the first)."""
        return cls(*metadata.get("pipeline_segment", (0, 0)))

    def end(self, n: int, pipelined: bool) -> int:
        """The call after the last one, for `n` batches in all."""
        batches = n - self.first_batch
        fill_and_drain = 2 if pipelined and batches > 0 else 0
        return self.first_call + max(batches, 0) + fill_and_drain

    def feeds(self, call: int, n: int) -> bool:
        """Whether `call` takes a batch (the ones after drain the pipeline)."""
        return call - self.first_call < n - self.first_batch


class _Run:
    """The mutable state of one training loop."""

    def __init__(self, config: RunConfig, options: TrainOptions, mesh: Mesh):
        self.config, self.options, self.mesh = config, options, mesh
        self.pipelined = (
            config.training.pipelined if options.pipelined is None else options.pipelined
        )
        if config.model.pipeshard is not None and not self.pipelined:
            raise ValueError(
                "model.pipeshard runs the dense tower inside SC/TC pipelined training; set "
                "training.pipelined: true (or drop --no-pipelined). Without pipelining the "
                "whole step is one compiled program, with the tower unpipelined."
            )
        key_tables, key_dense = jax.random.split(jax.random.key(config.seed))
        # The FDO limits read the record files' indexes, and the first read
        # starts numba's CPU target (Python work, most of the limits' time):
        # beside the dense model's initialization, which compiles without the
        # GIL (docs/benchmarks.md). Neither runs a collective.
        with concurrent.futures.ThreadPoolExecutor(1, "sparseflow-limits") as beside:
            limited_specs = beside.submit(_feature_specs, config, options, mesh)
            self.dense_model = _dense_model.dense_model(
                config, mesh, model_class=options.model, loss=options.loss
            )
            self.state = dense_state(config, self.dense_model, key_dense, mesh)
            specs = limited_specs.result()
        if not self.dense_model.per_example_logits:
            _log.info(
                "The model's outputs are not per-example logits: no AUC is reported "
                "(evaluate it with a metric of its own, as sparseflow.retrieval.recall_at_k)."
            )
        self.metrics = {}
        if options.metrics:
            outputs = _dense_model.abstract_outputs(
                self.dense_model,
                embedding.feature_dims(specs),
                config.layout.num_dense_features,
                config.global_batch_size,
            )
            self.metrics = _eval_metrics.check_metrics(
                options.metrics, outputs, config.global_batch_size
            )
        self.use_specs(specs)
        self.tables = embedding.init_embedding_variables(
            key_tables, self.specs, mesh, num_sc_per_device=config.mesh.partitions_per_device
        )
        self.pipeline_state = None
        self.segment = _Segment()
        self.next_call: int | None = None  # in the loop: the call its next batch is for
        self.losses: list[float] = []
        self.window = collections.deque(maxlen=max(config.training.log_every, 1))

    def use_specs(self, specs) -> None:
        """Lays batches out under `specs` from now on (a new step, compiled on first use)."""
        self.specs = specs
        self.stages = stages(self.config, specs, self.mesh, self.dense_model)
        self.pipelined_step = _pipelined_step(self.stages) if self.pipelined else None

    def arrays(self) -> dict[str, Any]:
        arrays = {"state": self.state, "tables": self.tables}
        if self.pipelined:
            arrays["pipeline"] = self.pipeline_state
        return arrays

    def set_arrays(self, arrays: dict[str, Any]) -> None:
        self.state, self.tables = arrays["state"], arrays["tables"]
        self.pipeline_state = arrays.get("pipeline")

    def record(self, output) -> None:
        """Keeps the loss and predictions of the next batch (batches train in order).

        Raises:
          TrainingDivergedError: the loss is NaN or infinite.
        """
        loss = float(output.loss)
        if not math.isfinite(loss):
            # losses[i] is the loss of global batch i, trained by step i + 1.
            batch = len(self.losses)
            rows = pipelines.batch_record_indices(
                self.options.data, _batching(self.config, training=True), batch
            )
            raise TrainingDivergedError(
                f"The loss of step {batch + 1} (global batch {batch} of the input) is {loss}; "
                "training stopped without saving that step or any later one, so the last "
                "checkpoint written is the last good one. This process's rows of that batch "
                f"are the dataset's records {_ranges(rows)} (counted over its files in "
                "order). Look for NaN or infinite values in them, or lower the learning rates."
            )
        self.losses.append(loss)
        if self.dense_model.per_example_logits:
            self.window.append((_gathered(output.logits), _gathered(output.labels)))

    def window_auc(self) -> float:
        if not self.window:
            return float("nan")
        logits, labels = (np.concatenate(x) for x in zip(*self.window, strict=True))
        return _model.roc_auc(labels, logits)


def stages(config: RunConfig, specs, mesh: Mesh, dense_model) -> Stages:
    """The stage functions of `config`'s run with `dense_model` on batches laid out under `specs`
    (`Stages.eval_logits` is the evaluation's forward)."""
    return Stages(
        feature_specs=specs,
        mesh=mesh,
        optimizer=_model.dense_optimizer(config.model),
        enable_minibatching=config.preprocessing.enable_minibatching,
        pipeshard=config.model.pipeshard,
        dense_model=dense_model,
    )


def dense_state(config: RunConfig, dense_model, key: jax.Array, mesh: Mesh) -> TrainState:
    """The dense model's initial parameters, optimizer state and step, on every device of
    `mesh`."""
    return init_train_state(key, dense_model, _model.dense_optimizer(config.model), mesh)


def abstract_dense_state(config: RunConfig, dense_model, sharding) -> TrainState:
    """The shapes and dtypes of `dense_state`, each with `sharding` (to restore it into)."""
    optimizer = _model.dense_optimizer(config.model)
    shapes = jax.eval_shape(lambda: initial_train_state(jax.random.key(0), dense_model, optimizer))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), shapes)


def _initial_pipeline_state(run: _Run, batch: pipelines.DeviceBatch):
    sharding = NamedSharding(run.mesh, PartitionSpec(run.mesh.axis_names[0]))
    return parallel.get_initial_state(
        parallel.CurrentStepInput(batch.sparse, _dense_inputs(batch)),
        run.state,
        run.tables,
        run.stages.sc_fwd,
        run.stages.tc,
        dense_input_sharding=sharding,
        sparse_input_sharding=sharding,
        aux_sharding=sharding,
        # Scalars and the output on every device, so that a restored state is
        # placed like the step's other arguments.
        replicated_sharding=NamedSharding(run.mesh, PartitionSpec()),
    )


def _number_of_steps(run: _Run, batches: pipelines.DeviceIterator) -> int:
    wanted = run.options.steps or run.config.training.steps or batches.num_batches
    if wanted > batches.num_batches:
        raise UsageError(
            f"{wanted} steps need {wanted} global batches but the data holds "
            f"{batches.num_batches} (x epochs); raise training.epochs or lower the steps."
        )
    return wanted


def train(config: RunConfig, options: TrainOptions) -> TrainResult:
    """Trains the recommender on `options.data` as `config` says.

    Raises:
      ValueError: bad data, specs or options (the message says which); a
        non-empty checkpoint folder without `resume`.
      CheckpointMismatchError: `resume` with a checkpoint of another run.
      CheckpointError: `resume` with checkpoints none of which restores.
      TrainingDivergedError: the loss or the parameters became non-finite.
    """
    entered = time.perf_counter()
    if options.checkpoint_dir is not None and not options.resume:
        check_fresh(options.checkpoint_dir)
    mesh = make_mesh(config.mesh.devices)
    run = _Run(config, options, mesh)
    checkpoints = _checkpoints(run) if options.checkpoint_dir is not None else None
    metrics = MetricsWriter(options.metrics_dir if jax.process_index() == 0 else None)
    if options.resume and checkpoints is not None:
        run.use_specs(_checkpoint_specs(run, checkpoints.newest_metadata()))
    with _input_failures_noted(options), _training_batches(run) as batches:
        n = _number_of_steps(run, batches)
        first = next(batches)
        if run.pipelined:
            run.pipeline_state = _initial_pipeline_state(run, first)
        start, pending = 0, first
        if options.resume and checkpoints is not None:
            read_as = reading_dict_params(_other_mesh(run), _identity(run, run.config))
            snapshot = checkpoints.restore_latest(run.arrays(), read_as=read_as)
            if snapshot is not None:
                run.set_arrays(snapshot.arrays)
                run.losses = list(snapshot.metadata["losses"])
                start, pending = snapshot.step, None
                run.segment = _Segment.of(snapshot.metadata)
                batches.use_specs(_checkpoint_specs(run, snapshot.metadata))
                batches.set_state(snapshot.iterator_state)
                _log.info("Resumed from the checkpoint at step %d.", start)
                if run.pipelined:
                    start = _new_segment_after_drain(run, n, start, snapshot.iterator_state)
        clock = _loop(run, batches, n, start, pending, checkpoints, metrics)
    eval_auc, eval_metrics = None, {}
    if options.eval_data is not None and (run.dense_model.per_example_logits or run.metrics):
        eval_auc, eval_metrics = evaluate(run, options.eval_data)
        for name, value in {"auc": eval_auc, **eval_metrics}.items():
            if value is not None:
                metrics.scalar(f"eval/{name}", value, n)
    metrics.close()
    if checkpoints is not None:
        checkpoints.close()
    trained = n - start
    seconds = clock.ended - clock.began
    return TrainResult(
        steps=n,
        losses=run.losses,
        train_auc=run.window_auc(),
        eval_auc=eval_auc,
        eval_metrics=eval_metrics,
        examples_per_s=trained * config.global_batch_size / seconds if seconds else 0.0,
        seconds=seconds,
        call_seconds=clock.calls,
        input_wait_seconds=clock.waits,
        time_to_first_step=(clock.first_step_end or clock.began) - entered,
        train_state=run.state,
        embedding_variables=run.tables,
        limits=embedding.stack_limits(run.specs),
    )


@contextlib.contextmanager
def _input_failures_noted(options: TrainOptions):
    """Adds to an input failure how to go on: a longer timeout, the checkpoints to resume."""
    try:
        yield
    except (pipelines.InputWorkerError, pipelines.InputTimeoutError) as error:
        if isinstance(error, pipelines.InputTimeoutError):
            error.add_note("sparseflow train --input-timeout SECONDS sets the timeout.")
        if options.checkpoint_dir is not None:
            error.add_note(
                "Training stopped; the checkpoints written are whole, and --resume goes on "
                "from the newest."
            )
        raise


def _training_batches(run: _Run) -> _limit_feedback.FeedbackIterator:
    config, options, mesh = run.config, run.options, run.mesh
    batching = _batching(config, training=True)
    return _limit_feedback.FeedbackIterator(
        lambda specs: _iterator(config, options, specs, mesh, options.data, training=True),
        run.specs,
        batch_stats=lambda specs, batch: pipelines.batch_layout_stats(
            options.data, batching, _preprocess_config(config, options, specs, mesh), batch
        ),
        on_new_specs=lambda specs: _take_raised_limits(run, specs),
        geometry=fdo_geometry(config),
        headroom=config.training.fdo_headroom,
        # One process writes the raises: the hosts agree on them.
        record=None
        if options.fdo_dir is None or jax.process_index() != 0
        else (options.fdo_dir, config.fdo_layout),
        agree=_hosts.gathered if jax.process_count() > 1 else None,
        position=_in_flight.next_batch,
    )


def _new_segment_after_drain(run: _Run, n: int, calls: int, iterator_state: bytes) -> int:
    """Starts a new segment where a checkpoint's drained pipeline is resumed for more batches.

    Returns the call to go on from. A checkpoint between the two draining
    calls gets the second one first, which applies the last batch's update.
    """
    fed = _in_flight.next_batch(iterator_state)
    segment = run.segment
    drained = (calls - segment.first_call) - (fed - segment.first_batch)
    if drained == 0 or n <= fed:
        return calls
    if drained == 1:
        _pipelined_call(run, calls - segment.first_call, fed - segment.first_batch, None)
        calls += 1
    run.segment = _Segment(first_batch=fed, first_call=calls)
    _log.info("The checkpoint's pipeline was drained; batches %d on fill a new one.", fed)
    return calls


def _checkpoint_specs(run: _Run, metadata: dict | None):
    """The run's specs with the limits a checkpoint of this mesh was written under."""
    written_here = metadata is not None and _mesh_change.written_here(metadata, run.config)
    limits = metadata.get("limits") if written_here else None
    return _limit_feedback.specs_with_metadata(run.specs, fdo_geometry(run.config), limits)


def _identity(run: _Run, config: RunConfig) -> dict[str, Any]:
    """The run identity of `run` with `config` (its own, or as on a checkpoint's mesh)."""
    return _run_identity.run_identity(
        config, run.options.data, pipelined=run.pipelined, processes=jax.process_count()
    )


def _checkpoints(run: _Run) -> Checkpoints:
    return Checkpoints(run.options.checkpoint_dir, run=_identity(run, run.config))


def _other_mesh(run: _Run) -> _mesh_change.OtherMesh:
    """Reads checkpoints of this run written on another mesh, laying them out for this one."""
    config, mesh = run.config, run.mesh
    in_flight = None
    if run.pipelined:
        fresh = run.pipeline_state

        def in_flight(saved, tables, snapshot: Snapshot):
            segment = _Segment.of(snapshot.metadata)
            next_batch = _in_flight.next_batch(snapshot.iterator_state)
            return _relaid_in_flight(run, saved, fresh, tables, segment, snapshot.step, next_batch)

    return _mesh_change.OtherMesh(config, mesh, lambda c: _identity(run, c), in_flight)


def _relaid_in_flight(
    run: _Run, saved, fresh, tables, segment: _Segment, calls: int, next_batch: int
) -> parallel.PipelineState:
    """`saved`, the state after `calls` calls, with its batches in flight read again and
    laid out under this run's specs and mesh (`_in_flight.relaid_pipeline_state`)."""
    preprocess = _preprocess_config(run.config, run.options, run.specs, run.mesh)
    batching = _batching(run.config, training=True)
    return _in_flight.relaid_pipeline_state(
        saved,
        fresh,
        tables,
        calls=calls - segment.first_call,
        first_batch=segment.first_batch,
        next_batch=next_batch,
        batch=lambda number: _in_flight.read_batch(
            run.options.data, batching, preprocess, run.mesh, number
        ),
        stages=run.stages,
    )


def _take_raised_limits(run: _Run, specs) -> None:
    """Lays batches out under `specs` (raised limits) from now on, and, in a
    pipelined loop, the batches in flight too, so that the next call goes on
    as a run started under `specs` would."""
    in_flight, calls = run.pipeline_state, run.next_call
    run.use_specs(specs)
    if in_flight is None or calls is None:
        return
    segment = run.segment
    next_batch = segment.first_batch + calls - segment.first_call
    preprocess = _preprocess_config(run.config, run.options, run.specs, run.mesh)
    shaped = _in_flight.read_batch(
        run.options.data, _batching(run.config, training=True), preprocess, run.mesh, next_batch
    )
    fresh = _initial_pipeline_state(run, shaped)
    run.pipeline_state = _relaid_in_flight(
        run, in_flight, fresh, run.tables, segment, calls, next_batch
    )


@dataclasses.dataclass
class _Clock:
    """Where the loop's time went: per call, and since the last log line.

    Attributes:
      began: `time.perf_counter()` when the loop started.
      calls: wall time of each step call.
      waits: time waited for each call's batch before it.
      first_step_end: `perf_counter()` at the end of the first call, or None.
      window_start: `perf_counter()` at the last log line (or the start).
      window_calls: calls since then.
      ended: `perf_counter()` when the loop ended.
    """

    began: float
    ended: float = 0.0
    calls: list[float] = dataclasses.field(default_factory=list)
    waits: list[float] = dataclasses.field(default_factory=list)
    first_step_end: float | None = None
    window_start: float = 0.0
    window_calls: int = 0

    def add(self, wait: float, call: float) -> None:
        self.waits.append(wait)
        self.calls.append(call)
        self.window_calls += 1
        if self.first_step_end is None:
            self.first_step_end = time.perf_counter()

    def window(self) -> tuple[float, float]:
        """`(seconds, share waiting for input)` since the window began; starts a new one."""
        now = time.perf_counter()
        seconds = now - self.window_start
        waited = sum(self.waits[len(self.waits) - self.window_calls :])
        self.window_start, self.window_calls = now, 0
        return seconds, (waited / seconds if seconds > 0 else 0.0)


def _loop(run: _Run, batches, n: int, start: int, pending, checkpoints, metrics) -> _Clock:
    """Runs calls `start..` to the end; returns where their time went."""
    with _setup_objects_frozen():
        total = run.segment.end(n, run.pipelined)
        every = run.config.training.checkpoint_every
        progress = Progress(total=n, initial=min(start, n), enabled=run.options.progress)
        began = time.perf_counter()
        clock, logged = _Clock(began=began, window_start=began), len(run.losses)
        for t in range(start, total):
            batch = None
            waiting = time.perf_counter()
            run.next_call = t
            if run.segment.feeds(t, n):
                batch, pending = pending or next(batches), None
            called = time.perf_counter()
            if run.pipelined:
                segment = run.segment
                _pipelined_call(run, t - segment.first_call, n - segment.first_batch, batch)
            else:
                run.state, run.tables, output = run.stages.sequential_step(
                    run.state, run.tables, batch.sparse, _dense_inputs(batch)
                )
                jax.block_until_ready((run.state, run.tables))
                run.record(output)
            clock.add(called - waiting, time.perf_counter() - called)
            if t == start:
                # The tables are initialized and the step compiled and run: what
                # that work freed, the steps do not use again.
                embedding.give_back_freed_memory()
            done = t + 1
            logged = _report(run, metrics, progress, logged, clock)
            if checkpoints is not None and (done % every == 0 or done == total):
                _save(run, checkpoints, batches, done)
            if run.options.stop_after == done:
                logging.shutdown()
                os._exit(0)  # noqa: SLF001 - a crash on purpose: no drain, no final checkpoint
        progress.close()
        clock.ended = time.perf_counter()
        return clock


@contextlib.contextmanager
def _setup_objects_frozen():
    """Keeps the objects alive on entry out of the garbage collector's full collections.

    The imports and the run's setup (about half a million objects) outlive
    the loop, and full collections, which the batches' garbage triggers every
    few dozen steps, would walk them all, taking CPU from the cores the step
    runs on (docs/benchmarks.md). Garbage of the setup is
    collected first, so none of it is kept; on exit they are collected as
    usual again, so a process that trains several times frees each run.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _pipelined_step(stages: Stages):
    """The pipelined step as `step(pipeline_input, state, tables, pipeline_state, *,
    valid)` (`valid`: `parallel.is_output_valid` of the call)."""
    if stages.pipeshard is None:
        step = parallel.jit_step(
            stages.sc_fwd,
            stages.tc,
            stages.sc_bwd,
            compiler_options=stages.step_compiler_options,
        )

        # One program for every call: the filling and draining calls run the TC
        # stage and discard it (`gradient_multiplier` 0, results equal). A
        # variant without it took a second compilation at a run's start, and
        # on several devices the steady variant a third: its inputs came
        # placed by the other variant's outputs first, then by its own
        # (docs/benchmarks.md).
        def one_program(*arguments, valid: bool):
            return step(*arguments, fake_tc_step=False, gradient_multiplier=np.float32(valid))

        return one_program
    # The host runs the TC stage only where it is real (no multiplier there).
    step = parallel.host_driven_step(
        stages.sc_fwd,
        stages.pipeshard_tc,
        stages.sc_bwd,
        compiler_options=stages.step_compiler_options,
    )

    def tc_where_valid(*arguments, valid: bool):
        return step(*arguments, fake_tc_step=not valid)

    return tc_where_valid


def _pipelined_call(run: _Run, t: int, n: int, batch) -> None:
    """Call `t` of the segment of `n` batches (`batch` None: a draining call)."""
    if batch is not None:
        pipeline_input = parallel.CurrentStepInput(batch.sparse, _dense_inputs(batch))
    else:
        pipeline_input = parallel.get_draining_input(run.pipeline_state)
    valid = parallel.is_output_valid(t, n)
    output, _, run.state, run.tables, run.pipeline_state = run.pipelined_step(
        pipeline_input, run.state, run.tables, run.pipeline_state, valid=valid
    )
    jax.block_until_ready((run.state, run.tables, run.pipeline_state))
    if valid:
        run.record(output)


def _report(run: _Run, metrics, progress, logged: int, clock: _Clock) -> int:
    """Updates the bar; logs a window when a multiple of log_every is reached.

    The log line has the window's examples/s and the share of its wall time
    the loop spent waiting for input: near 1, the input limits the run; near
    0, the step does.

    Returns the number of losses logged so far.
    """
    trained = len(run.losses)
    progress.update(trained, run.losses[-1] if trained else None)
    every = run.config.training.log_every
    if trained == logged or trained % every:
        return logged
    loss = float(np.mean(run.losses[-every:]))
    seconds, waiting = clock.window()
    # Batches trained, not calls: a pipelined run's first call trains none.
    examples = (trained - logged) * run.config.global_batch_size
    examples_per_s = examples / seconds if seconds > 0 else 0.0
    # A model without per-example logits has no AUC (`_Run.record` keeps none).
    auc = run.window_auc() if run.dense_model.per_example_logits else None
    _log.info(
        "step %d: loss %.4f%s, %.0f examples/s, %.0f%% of the time waiting for input",
        trained,
        loss,
        "" if auc is None else f", auc {auc:.4f}",
        examples_per_s,
        100 * waiting,
    )
    progress.throughput(examples_per_s, waiting)
    metrics.scalar("train/loss", loss, trained)
    if auc is not None:
        metrics.scalar("train/auc", auc, trained)
    metrics.scalar("train/examples_per_s", examples_per_s, trained)
    metrics.scalar("train/input_wait_share", waiting, trained)
    return trained


@jax.jit
def _all_finite(tree) -> jax.Array:
    floats = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in floats]))


def _save(run: _Run, checkpoints: Checkpoints, batches, done: int) -> None:
    # A finite loss does not rule out an update that made parameters NaN, nor
    # (pipelined) activations or gradients in flight that the next step applies.
    if not bool(_all_finite(run.arrays())):
        raise TrainingDivergedError(
            "Parameters, optimizer slots or values in flight are NaN or infinite after step "
            f"{done} (with finite losses); training stopped without saving them, so the last "
            "checkpoint written is the last good one. Lower the learning rates."
        )
    checkpoints.save(
        Snapshot(
            step=done,
            arrays=run.arrays(),
            iterator_state=batches.get_state(),
            metadata={
                "losses": run.losses,
                "config_hash": run.config.config_hash,
                "limits": _limit_feedback.limits_metadata(run.specs),
                "pipeline_segment": dataclasses.astuple(run.segment),
            },
        )
    )


def evaluate(run: _Run, data) -> tuple[float | None, dict[str, float]]:
    """The current model on `data` (one pass, file order): its AUC (None when the
    outputs are not per-example logits) and each of `run.metrics`' mean over the batches."""
    logits, labels = [], []
    means = _eval_metrics.MetricMeans(run.metrics)
    with _iterator(run.config, run.options, run.specs, run.mesh, data, training=False) as batches:
        steps = batches.num_batches
        if run.config.training.eval_batches is not None:
            steps = min(steps, run.config.training.eval_batches)
        for _, batch in zip(range(steps), batches, strict=False):
            # Finished before the metrics' program (a mean over the devices) is
            # dispatched: XLA:CPU can deadlock on two programs with collectives in flight.
            out = jax.block_until_ready(
                run.stages.eval_logits(
                    run.state.params, run.tables, batch.sparse, _dense_inputs(batch)
                )
            )
            if run.metrics:
                means.add(out, batch.labels)
            if run.dense_model.per_example_logits:
                logits.append(_gathered(out))
                labels.append(_gathered(batch.labels))
    if not run.dense_model.per_example_logits:
        return None, means.means()
    return _model.roc_auc(np.concatenate(labels), np.concatenate(logits)), means.means()
