"""The training program: exact resume after a crash, several processes, learning."""

from __future__ import annotations

import dataclasses
import gc
import re
import shutil
import weakref
from pathlib import Path

import jax
import numpy as np
import pytest
from train_cases import STEP_COMPILED, small_demo_config
from train_cases import cli as _cli

import pipelines
from sparseflow import _in_flight, _train, load_config
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


def _loss_of_batch(config, result: _train.TrainResult, data: str, number: int) -> float:
    """Float64 sigmoid cross-entropy of global batch `number` under `result`'s parameters."""
    options = _train.TrainOptions(data=data, progress=False)
    mesh = _train.make_mesh(config.mesh.devices)
    specs = _train._feature_specs(config, options, mesh)
    stages = _train._Run(config, options, mesh).stages
    batch = _in_flight.read_batch(
        data,
        _train._batching(config, training=True),
        _train._preprocess_config(config, options, specs, mesh),
        mesh,
        number,
    )
    logits = stages.eval_logits(
        result.train_state.params,
        result.embedding_variables,
        batch.sparse,
        _train._dense_inputs(batch),
    )
    z = np.asarray(logits, np.float64)
    y = np.asarray(batch.labels, np.float64)
    return float(np.mean(np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))))


def _assert_trained_on_after(first: _train.TrainResult, longer: _train.TrainResult, config, data):
    """`longer` continues `first` (pipelined, drained) with each later batch trained once."""
    n = len(first.losses)
    assert longer.losses[:n] == first.losses
    assert len(longer.losses) == longer.steps
    assert int(longer.train_state.step) == longer.steps  # one dense update per batch
    # The drained pipeline applied every update of the first run's batches, so
    # the next batch is looked up and scored on the state that run ended with.
    np.testing.assert_allclose(longer.losses[n], _loss_of_batch(config, first, data, n), rtol=1e-5)


def test_a_finished_pipelined_run_resumed_for_more_steps_trains_each_new_batch_once(
    small_run, trained_run, tmp_path
):
    _, _, config, data = small_run
    checkpoints = Path(shutil.copytree(trained_run.checkpoints, tmp_path / "longer"))
    options = dict(data=data, progress=False, pipelined=True, checkpoint_dir=checkpoints)
    longer = _train.train(config, _train.TrainOptions(**options, steps=6, resume=True))
    _assert_trained_on_after(trained_run.result, longer, config, data)


def test_a_run_stopped_between_its_draining_calls_resumes_for_more_steps(small_run):
    tmp, path, config, data = small_run
    checkpoints = tmp / "between-draining-calls"
    # 3 batches take calls 0-4; the checkpoint of call 4 (every 2) has one draining call left.
    stopped = _cli(
        "train", "--config", str(path), "--data", data, "--steps", "3", "--no-progress",
        "--checkpoint-dir", str(checkpoints), "--stop-after", "4",
    )  # fmt: skip
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    first = _train.train(config, _train.TrainOptions(data=data, steps=3, progress=False))
    longer = _train.train(
        config,
        _train.TrainOptions(
            data=data, steps=5, progress=False, checkpoint_dir=checkpoints, resume=True
        ),
    )
    _assert_trained_on_after(first, longer, config, data)


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


def test_stacked_and_unstacked_tables_train_alike(small_run):
    # By default (`stacks: auto`) the demo's ads and advertisers share a
    # stack, and so do categories and geo; apart, each table is its own. Same
    # rows, initializers and updates: the losses differ only by the order of
    # float sums.
    tmp, _, _, data = small_run
    losses = {}
    for stacks in ("auto", "none"):
        path = small_demo_config(tmp, {"steps": 4}, name=f"stacks-{stacks}.yaml", stacks=stacks)
        config = load_config(path)
        names = {
            f.table_spec.name for f in config.feature_specs.values() if f.table_spec.is_stacked()
        }
        assert bool(names) == (stacks == "auto")
        result = _train.train(config, _train.TrainOptions(data=data, progress=False))
        losses[stacks] = np.array(result.losses)
    assert losses["auto"].shape == (4,)
    np.testing.assert_allclose(losses["auto"], losses["none"], rtol=1e-5)
    assert not np.array_equal(losses["auto"][:1], losses["auto"][-1:])  # it trained


def test_the_clock_splits_a_window_into_examples_and_input_wait(monkeypatch):
    now = [10.0]
    monkeypatch.setattr(_train.time, "perf_counter", lambda: now[0])
    clock = _train._Clock(began=10.0, window_start=10.0)
    for wait, call in ((0.3, 0.1), (0.1, 0.5)):
        now[0] += wait + call
        clock.add(wait, call)
    now[0] += 1.0  # logging, a checkpoint: in the window, neither wait nor call
    assert clock.window() == (2.0, 0.2)
    assert clock.first_step_end == 10.4
    now[0] += 0.5
    clock.add(0.5, 0.0)
    assert clock.window() == (0.5, 1.0)  # only the new window's wait
    assert clock.waits == [0.3, 0.1, 0.5] and clock.calls == [0.1, 0.5, 0.0]


def test_the_log_shows_examples_per_second_and_input_wait(trained_run):
    assert trained_run.config.training.log_every == 2
    result = trained_run.result
    lines = re.findall(
        r"step (\d+): .* ([0-9]+) examples/s, ([0-9]+)% of the time waiting for input",
        trained_run.log,
    )
    assert [step for step, _, _ in lines] == ["2", "4"]
    assert all(int(rate) > 0 and 0 <= int(share) <= 100 for _, rate, share in lines)
    assert len(result.input_wait_seconds) == len(result.call_seconds) == 6  # pipelined: n + 2
    assert all(wait >= 0 for wait in result.input_wait_seconds)
    # set-up, the first batch and the first call (its compilation) come before it
    assert result.time_to_first_step > result.input_wait_seconds[0] + result.call_seconds[0]


def test_a_pipelined_run_compiles_its_step_once(trained_run):
    """The filling and draining calls run the steady program (their TC stage
    discarded): a variant without it compiled a second program, and on several
    devices the steady one twice, placed by each variant's outputs in turn."""
    assert trained_run.config.mesh.devices == 8
    assert trained_run.log.count(STEP_COMPILED) == 1, trained_run.log
    assert len(trained_run.result.losses) == 4


def test_what_the_start_freed_is_given_back_once_the_step_is_compiled(trained_run):
    """Once, at the first call: after the tables' initialization and the step's
    compilation, whose freed memory the steps do not use again."""
    assert trained_run.given_back == [1]
