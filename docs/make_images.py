"""Draws the README's pictures from a finished demo run.

    make demo                        # or `sparseflow demo`, from the repository root
    python docs/make_images.py       # writes docs/images/fdo.png and docs/images/training.png

`fdo.png` is the figure of `sparseflow fdo --plot` for the demo's FDO stats;
`training.png` is the loss and the AUC the demo logged to TensorBoard,
against the step. `--config` names another config's demo run.
"""

from __future__ import annotations  # noqa: I001 (sparseflow first, see below)

# First, unsorted: sparseflow sets TensorFlow's logging defaults and filters Beam's import
# notice, which must precede the imports of tensorflow and beam_jobs below.
import sparseflow  # noqa: F401
import argparse
from pathlib import Path

import numpy as np
import tensorflow as tf
from matplotlib.figure import Figure

import beam_jobs
import embedding
from sparseflow import _demo, _fdo_command
from sparseflow._cli import load_cli_config
from sparseflow._config import RunConfig

IMAGES = Path(__file__).resolve().parent / "images"


def read_scalars(metrics_dir: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """`{tag: (steps, values)}` of every TensorBoard scalar in `metrics_dir`, by step."""
    points: dict[str, dict[int, float]] = {}
    for path in sorted(metrics_dir.glob("events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(str(path)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                points.setdefault(value.tag, {})[event.step] = tf.make_ndarray(value.tensor).item()
    if not points:
        raise FileNotFoundError(f"no TensorBoard scalars in {metrics_dir}; run `make demo` first")
    return {
        tag: (np.array(sorted(by_step)), np.array([by_step[s] for s in sorted(by_step)]))
        for tag, by_step in points.items()
    }


def draw_training(scalars: dict[str, tuple[np.ndarray, np.ndarray]], path: Path) -> None:
    """Loss and AUC against the step: training as lines, the held-out AUC as a point."""
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


def draw_fdo(config: RunConfig, fdo_dir: Path, path: Path) -> None:
    stats = embedding.load_fdo_stats(fdo_dir, expected_config_hash=None, expected_geometry=None)
    beam_jobs.plot_fdo_stats(
        stats,
        path,
        headroom=config.training.fdo_headroom,
        configured_limits=_fdo_command.configured_limits(config),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="demo", help="the demo's config (default: demo)")
    parser.add_argument("--out", type=Path, default=IMAGES, help=f"(default: {IMAGES})")
    args = parser.parse_args()
    config = load_cli_config(args.config)
    run = _demo.run_dir(config)
    args.out.mkdir(parents=True, exist_ok=True)
    draw_fdo(config, run / "fdo", args.out / "fdo.png")
    draw_training(read_scalars(run / "metrics"), args.out / "training.png")
    print(f"Wrote {args.out / 'fdo.png'} and {args.out / 'training.png'} from {run}")


if __name__ == "__main__":
    main()
