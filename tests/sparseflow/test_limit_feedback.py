"""Limits that follow the data: a batch over the FDO limits raises them, and the raise is kept.

The case: a census-like dataset of low-cardinality columns, FDO stats computed
over exactly the batches training draws (so no spread margin, headroom 1),
then the data regenerated (same size, other values) before training: some
shuffled batch needs more ids in a partition than the stats allow.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil

import jax
import numpy as np
import pytest
import yaml
from train_cases import cli as _cli
from train_cases import write_data

import beam_jobs
import embedding
import pipelines
from sparseflow import _fdo_run, _limit_feedback, _train, load_config
from sparseflow._checkpoint import Checkpoints

EXAMPLES = 640
STEPS = 6
_COLUMNS = {"workclass": 8, "education": 16, "occupation": 15, "relationship": 6, "sex": 2}


@pytest.fixture(scope="module")
def census(tmp_path_factory):
    """`(directory, config path, config, data, fdo dir)`: stats of other data than `data`."""
    tmp = tmp_path_factory.mktemp("census")
    table = {
        "embedding_dim": 4,
        "combiner": "sum",
        "optimizer": {"type": "sgd", "learning_rate": 0.1},
        "initializer": {"type": "uniform", "scale": 0.05},
        "max_ids_per_partition": 8,
        "max_unique_ids_per_partition": 8,
    }
    raw = {
        "name": "census",
        "seed": 0,
        "mesh": {"devices": 8, "partitions_per_device": 2},
        "global_batch_size": 128,
        "preprocessing": {"allow_id_dropping": False, "enable_minibatching": False},
        "tables": [{"name": n, "vocabulary_size": v, **table} for n, v in _COLUMNS.items()],
        "features": [{"name": n, "table": n} for n in _COLUMNS],
        "dense_features": 2,
        "dataset": {"dir": str(tmp / "data")},
        "synthetic": {
            "examples": EXAMPLES,
            "eval_examples": 10,
            "features": {n: {"valency": [1, 1], "zipf": 1.1} for n in _COLUMNS},
        },
        "training": {
            "steps": STEPS,
            "epochs": 2,
            "pipelined": False,
            "fdo_headroom": 1.0,
            "checkpoint_every": 2,
            "log_every": 2,
        },
    }
    path = tmp / "census.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load_config(path)
    fdo_data = write_data(config, tmp / "fdo_data", examples=EXAMPLES, seed=1)
    fdo_dir = tmp / "fdo"
    beam_jobs.run_fdo_job(_fdo_run.job_config(config), fdo_data, str(fdo_dir))
    data = write_data(config, tmp / "data", examples=EXAMPLES, seed=2)
    return tmp, path, config, data, fdo_dir


def _fdo_copy(census, name: str):
    """A copy of the stats directory, so that each run records its own raises."""
    tmp, _, _, _, fdo_dir = census
    return shutil.copytree(fdo_dir, tmp / name)


def _options(census, fdo_dir, **more) -> _train.TrainOptions:
    return _train.TrainOptions(data=census[3], fdo_dir=fdo_dir, progress=False, **more)


def _first_breach(census, fdo_dir) -> tuple[int, embedding.LimitBreachError] | None:
    """The first training batch the initial limits cannot lay out and its error, or None."""
    _, _, config, data, _ = census
    mesh = _train.make_mesh(config.mesh.devices)
    specs = _train._feature_specs(config, _options(census, fdo_dir), mesh)
    host = pipelines.make_grain_iterator(
        data,
        batching=_train._batching(config, training=True),
        preprocess=_train._preprocess_config(config, _options(census, fdo_dir), specs, mesh),
        log_interval_s=None,
    )
    with host:
        for batch in range(STEPS):
            try:
                next(host)
            except embedding.LimitBreachError as error:
                return batch, error
    return None


def test_a_breach_raises_the_limit_records_it_and_training_goes_on(census, caplog):
    _, _, config, _, _ = census
    fdo_dir = _fdo_copy(census, "fdo_raise")
    found = _first_breach(census, fdo_dir)
    assert found is not None, "the stats' limits hold: no case"
    breach, error = found
    assert error.batch_number == breach
    # The census tables stack into one (`stacks: auto`), whose buffer per
    # device the other data outgrow first (apart, a table's id limit was).
    assert "is too small for this batch" in str(error)

    with caplog.at_level(logging.WARNING, logger="sparseflow._limit_feedback"):
        result = _train.train(config, _options(census, fdo_dir))
    assert len(result.losses) == STEPS and all(np.isfinite(result.losses))
    assert f"Global batch {breach} breaches the limits" in caplog.text

    geometry = _train.fdo_geometry(config)
    raises = embedding.load_limit_raises(fdo_dir, layout=config.fdo_layout, geometry=geometry)
    assert raises is not None and raises.batches[0] == breach
    # The next run starts from the raised limits: the batch now lays out.
    mesh = _train.make_mesh(config.mesh.devices)
    specs = _train._feature_specs(config, _options(census, fdo_dir), mesh)
    limits = embedding.stack_limits(specs)
    for name, raised in raises.stacks.items():
        assert limits[name] == raised
    assert _first_breach(census, fdo_dir) is None


def test_a_breach_in_a_grain_worker_raises_the_limit_as_one_in_process(census):
    # The breach is raised inside a worker process and reaches the trainer
    # through Grain, which then stops that worker: the error, not the
    # worker's end, must reach the limit feedback.
    _, _, config, _, _ = census
    training = dataclasses.replace(config.training, workers=2, worker_priority="normal")
    in_workers = _train.train(
        dataclasses.replace(config, training=training),
        _options(census, _fdo_copy(census, "fdo_workers")),
    )
    in_process = _train.train(config, _options(census, _fdo_copy(census, "fdo_in_process")))
    assert in_workers.limits == in_process.limits
    assert in_workers.limits != embedding.stack_limits(
        _train._feature_specs(
            config, _options(census, census[4]), _train.make_mesh(config.mesh.devices)
        )
    )
    np.testing.assert_allclose(in_workers.losses, in_process.losses, rtol=1e-6)


def test_a_pipelined_run_raises_the_limit_and_goes_on_as_if_started_from_it(census):
    tmp, path, config, _, fdo = census
    # Data (of seed 6) whose first breach comes with two batches in flight.
    census = (tmp, path, config, write_data(config, tmp / "late", examples=EXAMPLES, seed=6), fdo)
    fdo_dir = _fdo_copy(census, "fdo_pipelined")
    breach, _ = _first_breach(census, fdo_dir)
    assert breach >= 2, "no batch in flight at the breach: no case"
    raised = _train.train(config, _options(census, fdo_dir, pipelined=True))
    geometry = _train.fdo_geometry(config)
    raises = embedding.load_limit_raises(fdo_dir, layout=config.fdo_layout, geometry=geometry)
    assert raises.batches == (breach,)
    # The reference starts from the recorded limits (the raise read back from
    # fdo_dir), so its batches in flight were laid out under them all along.
    assert _first_breach(census, fdo_dir) is None
    reference = _train.train(config, _options(census, fdo_dir, pipelined=True))
    assert raised.limits == reference.limits
    np.testing.assert_allclose(raised.losses, reference.losses, rtol=1e-6)
    for a, b in zip(_leaves(raised), _leaves(reference), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_processes_agree_on_a_raise_and_go_on_as_if_started_from_it(census):
    tmp, path, _, _, _ = census
    raw = yaml.safe_load(path.read_text())
    raw["mesh"]["processes"] = 2
    two = tmp / "census-two-processes.yaml"
    two.write_text(yaml.safe_dump(raw))
    config = load_config(two)
    fdo_dir = tmp / "fdo-two-processes"
    fdo_data = write_data(config, tmp / "fdo-data-two-processes", examples=EXAMPLES, seed=1)
    beam_jobs.run_fdo_job(_fdo_run.job_config(config), fdo_data, str(fdo_dir))
    # Data (of seed 6) whose batch 3 breaches on process 0's rows only, two batches in flight.
    data = write_data(config, tmp / "late-two-processes", examples=EXAMPLES, seed=6)

    def run(checkpoints: str) -> tuple[str, dict]:
        done = _cli(
            "train", "--config", str(two), "--data", data, "--fdo", str(fdo_dir),
            "--num-processes", "2", "--pipelined", "--no-progress",
            "--checkpoint-dir", str(tmp / checkpoints),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        saved = Checkpoints(tmp / checkpoints, run=None)
        metadata = saved.newest_metadata()
        saved.close()
        return done.stderr, metadata

    log, raised = run("two-processes-raised")
    # Both processes raise at the batch, though only process 0's rows breach.
    assert log.count("Global batch 3 breaches the limits (the rows of process 0)") == 2, log
    geometry = embedding.FdoGeometry(
        global_batch_size=config.global_batch_size, devices=8, partitions_per_device=2, processes=2
    )
    raises = embedding.load_limit_raises(fdo_dir, layout=config.fdo_layout, geometry=geometry)
    assert raises.batches == (3,)
    # The reference starts from the recorded raise: nothing breaches.
    log, reference = run("two-processes-reference")
    assert "breaches" not in log
    assert raised["limits"] == reference["limits"]
    assert len(raised["losses"]) == STEPS
    np.testing.assert_allclose(raised["losses"], reference["losses"], rtol=1e-6)


def _leaves(result: _train.TrainResult) -> list[np.ndarray]:
    return [
        np.asarray(x) for x in jax.tree.leaves((result.train_state, result.embedding_variables))
    ]


def test_resume_after_a_raise_is_exact(census):
    tmp, path, config, data, _ = census
    uninterrupted = _train.train(config, _options(census, _fdo_copy(census, "fdo_whole")))

    fdo_dir = _fdo_copy(census, "fdo_crash")
    breach, _ = _first_breach(census, fdo_dir)
    stop = breach + 2 + breach % 2  # the checkpoint at the stop holds the raised limits
    assert stop < STEPS
    checkpoints = tmp / "checkpoints"
    argv = ["--config", str(path), "--data", data, "--fdo", str(fdo_dir), "--no-progress"]
    crashed = _cli("train", *argv, "--checkpoint-dir", str(checkpoints), "--stop-after", str(stop))
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    # Resumed with the stats alone (not the raises the crashed run recorded), the
    # run starts from the stats' limits and takes the checkpoint's.
    fresh = _fdo_copy(census, "fdo_fresh")
    initial = _train._feature_specs(
        config, _options(census, fresh), _train.make_mesh(config.mesh.devices)
    )
    saved = Checkpoints(checkpoints, run=None)
    assert saved.steps()[-1] == stop
    assert saved.newest_metadata()["limits"] != _limit_feedback.limits_metadata(initial)
    saved.close()

    resumed = _train.train(config, _options(census, fresh, checkpoint_dir=checkpoints, resume=True))
    assert resumed.losses == uninterrupted.losses
    assert resumed.limits == uninterrupted.limits != embedding.stack_limits(initial)
    # Under the checkpoint's limits no batch breached again: nothing was recorded.
    geometry = _train.fdo_geometry(config)
    assert embedding.load_limit_raises(fresh, layout=config.fdo_layout, geometry=geometry) is None
    for a, b in zip(_leaves(resumed), _leaves(uninterrupted), strict=True):
        np.testing.assert_array_equal(a, b)
