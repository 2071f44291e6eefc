"""Checks that a picture a command wrote is a PNG with its data drawn."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib import colors, image


def assert_drawn_png(path: Path, colour: str) -> None:
    """`path` is a PNG image with data drawn in `colour` (a matplotlib colour name) on it."""
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(path)[..., :3]
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 10  # not one flat colour
    drawn = np.all(np.abs(pixels - colors.to_rgb(colour)) < 0.02, axis=-1)
    assert drawn.sum() > 50, f"no {colour} data drawn in {path}"
