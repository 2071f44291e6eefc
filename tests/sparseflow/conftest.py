"""The small training run shared by the training tests, and a checkpoint of it."""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path
from typing import NamedTuple

import jax
import pytest
from predict_cases import PREDICTED_RECORDS
from train_cases import STEP_COMPILED, small_demo_config, write_data

import embedding
import pipelines
from sparseflow import _train, load_config


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """`(directory, config path, config, data)` of a small run with checkpoints every 2 steps."""
    tmp = tmp_path_factory.mktemp("train")
    path = small_demo_config(tmp, {"checkpoint_every": 2, "log_every": 2})
    config = load_config(path)
    return tmp, path, config, write_data(config, tmp / "data")


@contextlib.contextmanager
def _log_of(levels: dict[str, int]):
    """The messages of the named loggers at their given levels, as text, while inside."""
    text = io.StringIO()
    handler = logging.StreamHandler(text)
    loggers = {name: logging.getLogger(name) for name in levels}
    before = {name: logger.level for name, logger in loggers.items()}
    for name, logger in loggers.items():
        logger.setLevel(levels[name])
        logger.addHandler(handler)
    try:
        yield text
    finally:
        for name, logger in loggers.items():
            logger.removeHandler(handler)
            logger.setLevel(before[name])


class TrainedRun(NamedTuple):
    """4 pipelined steps of the small demo run (a checkpoint every 2 steps, a log line every 2).

    Attributes:
      log: what it logged: sparseflow._train's lines from INFO, and JAX's
        line for each program it compiled (`jax.log_compiles`).
      given_back: at each call of `embedding.give_back_freed_memory`, how many
        compilations of the pipelined step the log held.
    """

    config: object
    result: _train.TrainResult
    checkpoints: Path
    log: str
    given_back: list[int]


@pytest.fixture(scope="module")
def trained_run(small_run) -> TrainedRun:
    tmp, _, config, data = small_run
    checkpoints = tmp / "trained-checkpoints"
    levels = {"sparseflow._train": logging.INFO, "jax._src.dispatch": logging.WARNING}
    given_back, give_back = [], embedding.give_back_freed_memory
    with _log_of(levels) as log, jax.log_compiles(), pytest.MonkeyPatch.context() as patch:

        def recorded() -> bool:
            given_back.append(log.getvalue().count(STEP_COMPILED))
            return give_back()

        patch.setattr(embedding, "give_back_freed_memory", recorded)
        result = _train.train(
            config,
            _train.TrainOptions(
                data=data, steps=4, pipelined=True, checkpoint_dir=checkpoints, progress=False
            ),
        )
    return TrainedRun(config, result, checkpoints, log.getvalue(), given_back)


@pytest.fixture(scope="module")
def trained(trained_run):
    """`(config, TrainResult, checkpoint dir)` of `trained_run`."""
    return trained_run.config, trained_run.result, trained_run.checkpoints


@pytest.fixture(scope="module")
def records(small_run) -> list[bytes]:
    tmp, _, config, _ = small_run
    data = write_data(config, tmp / "predict-data", examples=PREDICTED_RECORDS, seed=7)
    return list(pipelines.read_records(pipelines.list_record_files(data)))
