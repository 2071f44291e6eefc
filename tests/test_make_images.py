"""docs/make_images.py reads a run's TensorBoard scalars and draws the training curve."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from sparseflow._metrics import MetricsWriter

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def make_images():
    # docs/ is not a package: the script is loaded from its file, as `python docs/...` runs it.
    spec = importlib.util.spec_from_file_location("make_images", REPO / "docs" / "make_images.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_run(metrics: Path) -> None:
    writer = MetricsWriter(metrics)
    for step, loss, auc in [(50, 0.6, 0.7), (25, 0.7, 0.6)]:
        writer.scalar("train/loss", loss, step)
        writer.scalar("train/auc", auc, step)
    writer.scalar("eval/auc", 0.68, 50)
    writer.close()


def test_scalars_are_read_by_tag_in_step_order(make_images, tmp_path):
    _write_run(tmp_path)
    scalars = make_images.read_scalars(tmp_path)
    assert set(scalars) == {"train/loss", "train/auc", "eval/auc"}
    steps, losses = scalars["train/loss"]
    np.testing.assert_array_equal(steps, [25, 50])
    np.testing.assert_allclose(losses, [0.7, 0.6], rtol=1e-6)
    np.testing.assert_allclose(scalars["eval/auc"][1], [0.68], rtol=1e-6)


def test_the_training_curve_is_a_png(make_images, tmp_path):
    _write_run(tmp_path / "metrics")
    path = tmp_path / "training.png"
    make_images.draw_training(make_images.read_scalars(tmp_path / "metrics"), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_folder_without_scalars_says_to_run_the_demo(make_images, tmp_path):
    with pytest.raises(FileNotFoundError, match="make demo"):
        make_images.read_scalars(tmp_path)
