"""`Trainer`: what `sparseflow train` does, as a library call, for any Flax NNX model.

A `Trainer` holds a run config and, optionally, a model class (in place of
the config's `model` section) and a loss; `fit` trains on record files as
`sparseflow train` does (the same loop: Grain input, FDO limits and their
raises, SC/TC pipelining, checkpoints and exact resume, evaluation, metrics)
and returns the `TrainResult`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sparseflow import _launch, _train
from sparseflow._command_config import CommandConfig
from sparseflow._errors import UsageError
from sparseflow.config._run_config import RunConfig


@dataclasses.dataclass(frozen=True)
class Trainer:
    """Trains a recommender on sharded embedding tables.

    Args:
      config: a `RunConfig`, a YAML file, or a shipped config's name
        (`"demo"`): tables, features, mesh, batch, preprocessing, training.
      model: a Flax NNX model class built on `embedding.nnx.Embed`, trained in
        place of the config's model (see docs/training.md, "Your own model":
        `model(embed, num_dense_features, rngs=..., **model_args)`, called as
        `model(sparse_batch, dense)` for logits `float[batch]`); None: the
        config's `model` section.
      model_args: keyword arguments of `model`.
      loss: `(logits: float32[batch], labels: int32[batch]) -> float32[]`,
        minimized over the dense parameters and, through the activations,
        the tables; default: the model class's own `loss`, if it has one
        (it may then return other outputs, e.g. `towers.TwoTower`'s
        `float32[batch, batch]`), else the mean sigmoid cross-entropy.
      devices: the mesh's device count in place of `mesh.devices`, for a
        config given as a file or a name.
      metrics: `{name: (outputs, labels: int32[batch]) -> float[]}`, JAX
        functions of one batch (e.g. accuracy); each is reported on
        `fit`'s `eval_data` as its mean over the batches
        (`TrainResult.eval_metrics`, and `eval/<name>` in TensorBoard). They
        are checked on the model's outputs before training starts.

    Example (a model class `Wide` as in docs/training.md):

        trainer = sparseflow.Trainer("demo", Wide, model_args={"hidden": 64})
        result = trainer.fit("runs/demo/data/arrayrecord", steps=100)
        print(result.losses[-1], result.train_auc)
    """

    config: RunConfig | str | os.PathLike
    model: type | None = None
    model_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    loss: Callable[[Any, Any], Any] | None = None
    devices: int | None = None
    metrics: Mapping[str, Callable[[Any, Any], Any]] | None = None

    def fit(
        self,
        data: str | Sequence[str] | None = None,
        *,
        steps: int | None = None,
        eval_data: str | Sequence[str] | None = None,
        fdo_dir: str | os.PathLike | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        resume: bool = False,
        metrics_dir: str | os.PathLike | None = None,
        pipelined: bool | None = None,
        progress: bool = True,
    ) -> _train.TrainResult:
        """Trains on `data` (default: the config's `dataset.train`) as `sparseflow train` does.

        On CPU, as `sparseflow train` does, the backend shows the config's
        `mesh.devices` virtual devices if JAX has not started it yet and
        XLA_FLAGS does not set a count (a count JAX already uses must be
        the config's).

        Raises:
          UsageError, ConfigError: a bad config, data or model (the message
            says which); the errors of `sparseflow train` otherwise.
        """
        config = self._run_config()
        _launch.use_cpu_devices(config.mesh.devices)
        options = _train.TrainOptions(
            data=list(config.dataset.train_data) if data is None else data,
            eval_data=eval_data,
            steps=steps,
            pipelined=pipelined,
            fdo_dir=None if fdo_dir is None else Path(fdo_dir),
            checkpoint_dir=None if checkpoint_dir is None else Path(checkpoint_dir),
            resume=resume,
            metrics_dir=None if metrics_dir is None else Path(metrics_dir),
            progress=progress,
            model=self.model,
            loss=self.loss,
            metrics=self.metrics,
        )
        return _train.train(config, options)

    def _run_config(self) -> RunConfig:
        config = self.config
        if not isinstance(config, RunConfig):
            config = CommandConfig(config, self.devices).load()
        elif self.devices is not None:
            raise UsageError(
                "Trainer(devices=...) takes the place of a config file's mesh.devices; a "
                "RunConfig has its mesh already (load the file with the devices instead)."
            )
        if self.model is None:
            return config
        # The class and its arguments name the model in the run's identity
        # (checkpoints of another model are refused); `fit` hands the class itself.
        named = f"{self.model.__module__}:{self.model.__qualname__}"
        model = dataclasses.replace(config.model, module=named, args=dict(self.model_args))
        return dataclasses.replace(config, model=model)
