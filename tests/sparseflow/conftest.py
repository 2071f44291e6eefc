"""The small training run shared by the training tests."""

from __future__ import annotations

import pytest
from train_cases import small_demo_config, write_data

from sparseflow import load_config


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """`(directory, config path, config, data)` of a small run with checkpoints every 2 steps."""
    tmp = tmp_path_factory.mktemp("train")
    path = small_demo_config(tmp, {"checkpoint_every": 2, "log_every": 2})
    config = load_config(path)
    return tmp, path, config, write_data(config, tmp / "data")
