"""The config's `model` and `training` sections: the dense tower and how `train` runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pipelines
from parallel import allreduce
from sparseflow._model import ModelConfig
from sparseflow._tower_config import read_pipeshard, read_tower
from sparseflow.config._checker import (
    Node,
    build,
    check_kind,
    enum_choice,
    get,
    integer,
    mapping,
    path,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """How `sparseflow train` runs.

    Attributes:
      steps: training steps (global batches); None: one pass over the data.
      pipelined: overlap the sparse stages of one batch with the dense stage
        of the previous one (`parallel.step`).
      checkpoint_every: steps between checkpoints (one is also written at the end).
      log_every: steps between logged metrics.
      eval_batches: held-out batches evaluated at the end (None: all).
      workers: Grain worker processes per host (0: in-process).
      worker_priority: the workers' CPU scheduling (`pipelines.WorkerPriority`):
        "idle" runs them only on CPU time the training step leaves free.
      shuffle: shuffle the training records (seeded by `seed`) every epoch.
      epochs: passes over the training data when `steps` is None.
      fdo_headroom: factor applied to FDO limits.
      agreement_port: first port of the hosts' all-reduce groups (worker w
        uses `agreement_port + w`); 0 picks free ports (one process only).
      agreement_tls_dir: mutual TLS between the hosts' all-reduce nodes: a
        directory with `ca.crt`, `rank-<r>.crt` and `rank-<r>.key`
        (`parallel.allreduce.AllReduceSecurity`); relative to the config file.
      agreement_secret_file: a file holding the run's shared secret (at least
        16 bytes); every agreement message then carries an HMAC keyed by it.
        Relative to the config file. Without either, the agreement is
        insecure, for hosts on one machine.
    """

    steps: int | None = None
    pipelined: bool = True
    checkpoint_every: int = 100
    log_every: int = 10
    eval_batches: int | None = None
    workers: int = 0
    worker_priority: pipelines.WorkerPriority = pipelines.WorkerPriority.IDLE
    shuffle: bool = True
    epochs: int = 1
    fdo_headroom: float = 1.1
    agreement_port: int = 0
    agreement_tls_dir: Path | None = None
    agreement_secret_file: Path | None = None

    def agreement_security(self, run_id: str) -> allreduce.AllReduceSecurity | None:
        """The agreement's authentication for run `run_id`; None when insecure."""
        if self.agreement_tls_dir is None and self.agreement_secret_file is None:
            return None
        return allreduce.AllReduceSecurity(
            tls_dir=self.agreement_tls_dir,
            secret_file=self.agreement_secret_file,
            run_id=run_id,
        )


def _widths(node: Node, key: str, default: tuple[int, ...]) -> tuple[int, ...]:
    if key not in node.value:
        return default
    child = node.child(key)
    widths = tuple(check_kind(child.child(i), "int") for i in range(len(get(node, key, "list"))))
    for i, width in enumerate(widths):
        if width < 1:
            raise child.child(i).error(f"must be an integer >= 1, got {width}")
    return widths


_SHIPPED_TOWER_KEYS = ("bottom_mlp", "top_mlp", "tower", "pipeshard", "feature_projection")


def read_model(node: Node) -> ModelConfig:
    mapping(node, (), (*_SHIPPED_TOWER_KEYS, "learning_rate", "module", "args"))
    defaults = ModelConfig()
    if node.has("module"):
        return _read_module(node, defaults)
    if node.has("args"):
        raise node.child("args").error("takes the arguments of model.module, which is not set")
    return build(
        node,
        ModelConfig,
        dict(
            bottom_mlp=_widths(node, "bottom_mlp", defaults.bottom_mlp),
            top_mlp=_widths(node, "top_mlp", defaults.top_mlp),
            learning_rate=get(node, "learning_rate", "number", defaults.learning_rate),
            tower=read_tower(node.child("tower")) if node.has("tower") else defaults.tower,
            pipeshard=read_pipeshard(node.child("pipeshard")) if node.has("pipeshard") else None,
            feature_projection=get(node, "feature_projection", "bool", defaults.feature_projection),
        ),
    )


def _read_module(node: Node, defaults: ModelConfig) -> ModelConfig:
    """`model.module: "package.module:Class"` with `model.args`: a user's NNX model."""
    module = get(node, "module", "str")
    package, colon, name = module.partition(":")
    if not colon or not package or not name.isidentifier():
        raise node.child("module").error(
            f'must be "package.module:Class" (a Flax NNX model class), got {module!r}'
        )
    shipped = [key for key in _SHIPPED_TOWER_KEYS if node.has(key)]
    if shipped:
        raise node.child(shipped[0]).error(
            "configures the shipped towers; with model.module, the model's own arguments go "
            "in model.args"
        )
    args = get(node, "args", "mapping", {}) if node.has("args") else {}
    return build(
        node,
        ModelConfig,
        dict(
            learning_rate=get(node, "learning_rate", "number", defaults.learning_rate),
            module=module,
            args=dict(args),
        ),
    )


def read_training(node: Node, config_dir: Path) -> TrainingConfig:
    fields = {f.name: f.default for f in dataclasses.fields(TrainingConfig)}
    mapping(node, (), tuple(fields))
    values = dict(
        steps=integer(node, "steps"),
        pipelined=get(node, "pipelined", "bool", fields["pipelined"]),
        checkpoint_every=integer(node, "checkpoint_every", fields["checkpoint_every"]),
        log_every=integer(node, "log_every", fields["log_every"]),
        eval_batches=integer(node, "eval_batches"),
        workers=integer(node, "workers", fields["workers"], minimum=0),
        worker_priority=enum_choice(
            node, "worker_priority", fields["worker_priority"], "worker priority"
        ),
        shuffle=get(node, "shuffle", "bool", fields["shuffle"]),
        epochs=integer(node, "epochs", fields["epochs"]),
        fdo_headroom=get(node, "fdo_headroom", "number", fields["fdo_headroom"]),
        agreement_port=integer(node, "agreement_port", fields["agreement_port"], minimum=0),
        agreement_tls_dir=path(node, "agreement_tls_dir", config_dir),
        agreement_secret_file=path(node, "agreement_secret_file", config_dir),
    )
    if values["fdo_headroom"] < 1:
        raise node.child("fdo_headroom").error(f"must be >= 1, got {values['fdo_headroom']}")
    return TrainingConfig(**values)
