"""The one-line summary of a training run that `train` and `demo` print."""

from __future__ import annotations

import math

from sparseflow import _train
from sparseflow.config._run_config import RunConfig


def _fmt(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.4f}"


def summary(config: RunConfig, result: _train.TrainResult) -> str:
    tail = result.losses[-config.training.log_every :]
    mean_loss = sum(tail) / len(tail) if tail else float("nan")
    return (
        f"trained {result.steps} steps of {config.global_batch_size} examples "
        f"({result.examples_per_s:,.0f} examples/s, {result.seconds:.1f} s): "
        f"loss {_fmt(mean_loss)}, train AUC {_fmt(result.train_auc)}, "
        f"eval AUC {_fmt(result.eval_auc)}"
    )
