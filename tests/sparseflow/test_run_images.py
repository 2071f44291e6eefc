"""The run pictures: TensorBoard scalars read back by tag and step, and drawn as a PNG."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from matplotlib import image
from png_checks import assert_drawn_png

from sparseflow._metrics import MetricsWriter
from sparseflow._run_images import draw_training, read_scalars


def _write_run(metrics: Path) -> None:
    writer = MetricsWriter(metrics)
    for step, loss, auc in [(50, 0.6, 0.7), (25, 0.7, 0.6)]:
        writer.scalar("train/loss", loss, step)
        writer.scalar("train/auc", auc, step)
    writer.scalar("eval/auc", 0.68, 50)
    writer.close()


def test_scalars_are_read_by_tag_in_step_order(tmp_path):
    _write_run(tmp_path)
    scalars = read_scalars(tmp_path)
    assert set(scalars) == {"train/loss", "train/auc", "eval/auc"}
    steps, losses = scalars["train/loss"]
    np.testing.assert_array_equal(steps, [25, 50])
    np.testing.assert_allclose(losses, [0.7, 0.6], rtol=1e-6)
    np.testing.assert_allclose(scalars["eval/auc"][1], [0.68], rtol=1e-6)


def test_the_training_curve_is_a_drawn_png(tmp_path):
    _write_run(tmp_path / "metrics")
    path = tmp_path / "training.png"
    assert draw_training(read_scalars(tmp_path / "metrics"), path) == str(path)
    assert_drawn_png(path, "tab:blue")  # the loss and training AUC lines


def test_a_blank_picture_fails_the_check(tmp_path):
    path = tmp_path / "blank.png"
    image.imsave(path, np.ones((200, 300, 3)))
    with pytest.raises(AssertionError):
        assert_drawn_png(path, "tab:blue")


def test_a_folder_without_scalars_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no TensorBoard scalars in {tmp_path}"):
        read_scalars(tmp_path)
