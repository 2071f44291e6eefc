"""The small training run shared by the training tests, and a checkpoint of it."""

from __future__ import annotations

import pytest
from predict_cases import PREDICTED_RECORDS
from train_cases import small_demo_config, write_data

import pipelines
from sparseflow import _train, load_config


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """`(directory, config path, config, data)` of a small run with checkpoints every 2 steps."""
    tmp = tmp_path_factory.mktemp("train")
    path = small_demo_config(tmp, {"checkpoint_every": 2, "log_every": 2})
    config = load_config(path)
    return tmp, path, config, write_data(config, tmp / "data")


@pytest.fixture(scope="module")
def trained(small_run):
    """`(config, TrainResult, checkpoint dir)` of 4 pipelined steps of the small demo run."""
    tmp, _, config, data = small_run
    checkpoints = tmp / "predict-checkpoints"
    result = _train.train(
        config,
        _train.TrainOptions(
            data=data, steps=4, pipelined=True, checkpoint_dir=checkpoints, progress=False
        ),
    )
    return config, result, checkpoints


@pytest.fixture(scope="module")
def records(small_run) -> list[bytes]:
    tmp, _, config, _ = small_run
    data = write_data(config, tmp / "predict-data", examples=PREDICTED_RECORDS, seed=7)
    return list(pipelines.read_records(pipelines.list_record_files(data)))
