"""Pictures of a run: the FDO spread per partition, and loss and AUC against the step.

`sparseflow demo` draws both into its run folder; `docs/make_images.py`
redraws them from a finished demo run for the README. Both use a bare
matplotlib `Figure` (the Agg canvas), never pyplot: no display, no global
figure registry.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

import beam_jobs
import embedding
from sparseflow._fdo_run import configured_limits
from sparseflow.config._run_config import RunConfig

Scalars = dict[str, tuple[np.ndarray, np.ndarray]]
"""`{tag: (steps: int[n], values: float[n])}`, by step."""


def draw_fdo(config: RunConfig, stats: embedding.FdoStats, path: str | os.PathLike) -> str:
    """The `sparseflow fdo --plot` figure of offline `stats`, at the config's FDO headroom."""
    return beam_jobs.plot_fdo_stats(
        stats,
        path,
        headroom=config.training.fdo_headroom,
        configured_limits=configured_limits(config),
    )


def read_scalars(metrics_dir: Path) -> Scalars:
    """Every TensorBoard scalar in `metrics_dir` (the training's `--metrics-dir`).

    Raises:
      FileNotFoundError: the folder holds no scalars.
    """
    import tensorflow as tf  # seconds to import: only for the images

    points: dict[str, dict[int, float]] = {}
    for path in sorted(Path(metrics_dir).glob("events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(str(path)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                points.setdefault(value.tag, {})[event.step] = tf.make_ndarray(value.tensor).item()
    if not points:
        raise FileNotFoundError(f"no TensorBoard scalars in {metrics_dir}")
    return {
        tag: (np.array(sorted(by_step)), np.array([by_step[s] for s in sorted(by_step)]))
        for tag, by_step in points.items()
    }


def draw_training(scalars: Scalars, path: str | os.PathLike) -> str:
    """Loss and AUC against the step: training as lines, the held-out AUC as a point."""
    # Here, not at the top: every command imports this module (through the
    # demo's), and only the demo draws; matplotlib takes a second to import.
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 3.6), layout="constrained")
    loss_ax, auc_ax = figure.subplots(1, 2)
    loss_ax.plot(*scalars["train/loss"], marker=".")
    loss_ax.set(title="Training loss", xlabel="step", ylabel="log loss")
    auc_ax.plot(*scalars["train/auc"], marker=".", label="training batches")
    if "eval/auc" in scalars:
        auc_ax.plot(*scalars["eval/auc"], "o", color="tab:red", label="held-out split")
    auc_ax.set(title="AUC", xlabel="step", ylabel="AUC")
    auc_ax.legend(loc="lower right")
    for ax in (loss_ax, auc_ax):
        ax.grid(alpha=0.3)
    figure.savefig(path, dpi=90)
    return os.fspath(path)
