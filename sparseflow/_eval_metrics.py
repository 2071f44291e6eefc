"""A `Trainer`'s metrics: functions of the model's outputs and the labels, over the evaluation.

A metric is `(outputs, labels: int32[batch]) -> float[]`, a JAX function of
one batch (`outputs` are what the model returns: logits `float32[batch]` for
the shipped towers). The evaluation reports each metric as its mean over the
evaluation's batches, as Keras does for a metric given as a function; a
quantity that does not average over batches (an AUC, a recall over the whole
catalogue) belongs in its own pass over `TrainResult`'s model.

Metrics are checked on the model's abstract outputs before anything trains,
so a metric that cannot take them fails in seconds, not after the run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

from sparseflow._dense_model import check_scalar_function
from sparseflow._errors import UsageError

Metric = Callable[[Any, jax.Array], jax.Array]


def check_metrics(metrics: Mapping[str, Metric], outputs: Any, batch: int) -> dict[str, Metric]:
    """`metrics` as a dict, each checked to give a float scalar on `outputs`.

    Args:
      metrics: by name.
      outputs: the model's outputs on a batch of `batch` examples, abstract
        (`sparseflow._dense_model.abstract_outputs`).
      batch: the batch's examples.

    Raises:
      UsageError: a name that is not a non-empty string or is `auc` (the
        evaluation's own), a metric that is not callable, fails on `outputs`
        and labels `int32[batch]`, or returns anything but a float scalar.
    """
    if not isinstance(metrics, Mapping):
        raise UsageError(
            f"metrics must map names to functions (outputs, labels) -> float scalar, got "
            f"{type(metrics).__name__}."
        )
    checked = {}
    for name, metric in metrics.items():
        if not isinstance(name, str) or not name or name == "auc":
            raise UsageError(
                f"metric name {name!r}: a metric's name is a non-empty string other than "
                "'auc' (the evaluation reports the AUC of per-example logits itself)."
            )
        if not callable(metric):
            raise UsageError(f"metric {name!r} is {type(metric).__name__}, not a function.")
        check_scalar_function(metric, outputs, batch, f"metric {name!r}")
        checked[name] = metric
    return checked


class MetricMeans:
    """Running means of metrics over batches.

    Args:
      metrics: by name, as `check_metrics` returns them.
    """

    def __init__(self, metrics: Mapping[str, Metric]):
        self._values = jax.jit(
            lambda outputs, labels: {n: m(outputs, labels) for n, m in metrics.items()}
        )
        self._sums = dict.fromkeys(metrics, 0.0)
        self._batches = 0

    def add(self, outputs: Any, labels: jax.Array) -> None:
        """Adds one batch: its outputs and `labels: int32[batch]` (global arrays)."""
        values = jax.device_get(self._values(outputs, labels))
        for name, value in values.items():
            self._sums[name] += float(value)
        self._batches += 1

    def means(self) -> dict[str, float]:
        """Each metric's mean over the batches added (NaN before any)."""
        if not self._batches:
            return dict.fromkeys(self._sums, float("nan"))
        return {name: total / self._batches for name, total in self._sums.items()}
