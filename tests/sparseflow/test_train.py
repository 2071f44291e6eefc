"""The training program: exact resume after a crash, several processes, learning."""

from __future__ import annotations

import dataclasses
import gc
import re
import weakref

import jax
import numpy as np
import pytest
from train_cases import cli as _cli

import pipelines
from sparseflow import _train
from sparseflow._errors import UsageError


def _leaves(result: _train.TrainResult) -> list[np.ndarray]:
    tree = (result.train_state, result.embedding_variables)
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


class _Node:
    """An object that can be part of a reference cycle."""


def test_the_loop_keeps_setup_objects_out_of_full_collections_until_it_ends():
    cycle = _Node()
    cycle.self = cycle
    setup_garbage = weakref.ref(cycle)
    del cycle
    with _train._setup_objects_frozen():
        assert setup_garbage() is None  # collected, not frozen
        assert gc.get_freeze_count() > 10_000  # the imports: numpy, jax, ...
    assert gc.get_freeze_count() == 0  # collected as usual after the loop


def test_resume_after_a_crash_is_exact(small_run):
    tmp, path, config, data = small_run
    options = dict(data=data, steps=8, progress=False)
    uninterrupted = _train.train(config, _train.TrainOptions(**options))

    checkpoints = tmp / "checkpoints"
    crashed = _cli(
        "train",
        "--config",
        str(path),
        "--data",
        data,
        "--steps",
        "8",
        "--no-progress",
        "--checkpoint-dir",
        str(checkpoints),
        "--stop-after",
        "4",
    )
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [2, 4]

    resumed = _train.train(
        config, _train.TrainOptions(**options, checkpoint_dir=checkpoints, resume=True)
    )
    assert resumed.losses == uninterrupted.losses
    assert len(resumed.losses) == 8
    for a, b in zip(_leaves(resumed), _leaves(uninterrupted), strict=True):
        np.testing.assert_array_equal(a, b)


def test_damaged_checkpoint_falls_back_to_the_previous_one(small_run, caplog):
    tmp, path, config, data = small_run
    checkpoints = tmp / "damaged"
    options = dict(data=data, steps=4, progress=False, pipelined=False)
    _train.train(config, _train.TrainOptions(**options, checkpoint_dir=checkpoints))
    # Damage the newest checkpoint: truncate every file of its arrays.
    for file in (checkpoints / "4" / "arrays").rglob("*"):
        if file.is_file():
            file.write_bytes(b"")
    resumed = _train.train(
        config, _train.TrainOptions(**options, checkpoint_dir=checkpoints, resume=True)
    )
    assert "cannot be restored" in caplog.text
    assert len(resumed.losses) == 4  # steps 3 and 4 trained again after step 2


def test_two_processes_report_the_same_loss(small_run):
    _, path, _, data = small_run
    done = _cli(
        "train",
        "--config",
        str(path),
        "--data",
        data,
        "--steps",
        "3",
        "--no-progress",
        "--num-processes",
        "2",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    losses = dict(re.findall(r"\[process (\d)\] .*?loss ([0-9.]+)", done.stdout))
    assert set(losses) == {"0", "1"}, done.stdout
    assert losses["0"] == losses["1"]


def test_model_learns_on_held_out_data(small_run):
    tmp, _, config, data = small_run
    held_out = tmp / "eval"
    pipelines.write_synthetic_dataset(
        config.synthetic.dataset,
        held_out,
        num_examples=2048,
        seed=config.seed,
        num_shards=1,
        formats=("arrayrecord",),
        held_out=True,
    )
    # 20 passes over 5120 examples in batches of 512: 200 steps.
    config = dataclasses.replace(config, training=dataclasses.replace(config.training, epochs=20))
    result = _train.train(
        config,
        _train.TrainOptions(data=data, eval_data=str(held_out / "arrayrecord"), progress=False),
    )
    assert result.steps == 200
    assert result.eval_auc > 0.55


def test_a_device_count_other_than_the_configs_is_a_usage_error(small_run):
    """JAX showing more devices than `mesh.devices` (XLA_FLAGS set by hand)
    stops the run with a message naming both counts, not a layout error."""
    _, _, config, data = small_run
    fewer = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, devices=4))
    with pytest.raises(UsageError, match=r"mesh\.devices is 4, but JAX shows 8 devices"):
        _train.train(fewer, _train.TrainOptions(data=data))
