"""Draws the README's pictures from a finished demo run.

    make demo                        # or `sparseflow demo`, from the repository root
    python docs/make_images.py       # writes docs/images/fdo.png and docs/images/training.png

The pictures are the ones `sparseflow demo` draws into its run folder
(`fdo.png`: the FDO spread per partition; `training.png`: the loss and the
AUC it logged to TensorBoard, against the step), redrawn from the run's FDO
stats and TensorBoard scalars. `--config` names another config's demo run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import embedding
from sparseflow import _demo, _run_images
from sparseflow._cli import load_cli_config

IMAGES = Path(__file__).resolve().parent / "images"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="demo", help="the demo's config (default: demo)")
    parser.add_argument("--out", type=Path, default=IMAGES, help=f"(default: {IMAGES})")
    args = parser.parse_args()
    config = load_cli_config(args.config)
    run = _demo.run_dir(config)
    if not (run / "metrics").is_dir():
        raise SystemExit(f"No demo run in {run}: run `make demo` (or `sparseflow demo`) first.")
    stats = embedding.load_fdo_stats(run / "fdo", expected_config_hash=None, expected_geometry=None)
    args.out.mkdir(parents=True, exist_ok=True)
    _run_images.draw_fdo(config, stats, args.out / _demo.FDO_IMAGE)
    _run_images.draw_training(
        _run_images.read_scalars(run / "metrics"), args.out / _demo.TRAINING_IMAGE
    )
    print(f"Wrote {args.out / _demo.FDO_IMAGE} and {args.out / _demo.TRAINING_IMAGE} from {run}")


if __name__ == "__main__":
    main()
