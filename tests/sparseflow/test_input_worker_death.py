"""A Grain worker killed or stopped in the middle of `sparseflow train`: an error, never a hang.

The run's batches are larger than a pipe's buffer (64 KiB pickled), so a
worker killed while it sends one leaves half a batch in its pipe, as the
kernel's out-of-memory killer would. The worker is killed or stopped right
after the first checkpoint, in the middle of the first epoch. The workers
are found as the run's spawned children in /proc, not through the code under
test, so the pid an error names is the one really killed or stopped.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from process_cases import alive, grain_workers, wait_for
from tiny_config import tiny_config

import pipelines
from sparseflow import load_config

REPO = Path(__file__).resolve().parents[2]
BATCH = 512
BATCHES_PER_EPOCH = 64
EXAMPLES = BATCHES_PER_EPOCH * BATCH
# From the worker's death to the run's exit: the error comes within seconds,
# not after the default input timeout (600 s); more than this is a hang.
STOP_WITHIN_S = 120.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A folder with `tiny.yaml` (2 Grain workers, a checkpoint every 5 steps) and its data."""
    folder = tmp_path_factory.mktemp("worker_death")
    path = tiny_config(folder)
    raw = yaml.safe_load(path.read_text())
    raw.update(global_batch_size=BATCH, dense_features=64)
    raw["synthetic"]["examples"] = EXAMPLES
    for table in raw["tables"]:
        table.update(max_ids_per_partition=BATCH, max_unique_ids_per_partition=BATCH)
    raw["training"] = {"workers": 2, "epochs": 2_000, "checkpoint_every": 5, "log_every": 5}
    path.write_text(yaml.safe_dump(raw))
    config = load_config(path)
    pipelines.write_synthetic_dataset(
        config.synthetic.dataset, config.dataset.dir, num_examples=EXAMPLES, seed=0, num_shards=2
    )
    return folder


def _start_training(folder: Path, run: Path, *argv: str) -> subprocess.Popen:
    """`sparseflow train` on the config's 4 CPU devices, in a session of its own.

    Its checkpoints go to `run/checkpoints`, its output to `run/stdout` and `run/stderr`.
    """
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    command = [sys.executable, "-m", "sparseflow", "train", "--config", "tiny.yaml"]
    with (run / "stdout").open("a") as stdout, (run / "stderr").open("a") as stderr:
        return subprocess.Popen(
            [*command, "--no-progress", "--checkpoint-dir", str(run / "checkpoints"), *argv],
            stdout=stdout,
            stderr=stderr,
            env=env,
            cwd=folder,
            start_new_session=True,
        )


def _steps(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _signal_a_worker_mid_run(folder: Path, run: Path, sent: signal.Signals, *argv: str):
    """Starts a long run, sends `sent` to a Grain worker after the first checkpoint.

    Returns:
      `(the run's exit status, its last stderr line, the worker's pid)`;
      fails if the run does not stop within `STOP_WITHIN_S` or outlives its workers.
    """
    checkpoints = run / "checkpoints"
    process = _start_training(folder, run, "--steps", "100000", *argv)
    workers = []
    try:
        wait_for(
            lambda: process.poll() is not None or (checkpoints.is_dir() and _steps(checkpoints)),
            600,
            "no checkpoint was written",
        )
        assert process.poll() is None, (run / "stderr").read_text()[-3000:]
        workers = wait_for(
            lambda: len(grain_workers(process.pid)) == 2 and grain_workers(process.pid),
            60,
            "the run did not show its 2 Grain workers",
        )
        os.kill(workers[0], sent)
        try:
            status = process.wait(timeout=STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the run went on {STOP_WITHIN_S:.0f} s after its Grain worker {workers[0]} got "
                f"{sent.name}: a hang"
            ) from None
        # Nothing of the run outlives it.
        wait_for(
            lambda: not any(alive(worker) for worker in workers),
            30,
            f"the run's Grain workers {workers} did not end",
        )
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=60)
        for worker in workers:
            if alive(worker):
                os.kill(worker, signal.SIGKILL)
    return status, (run / "stderr").read_text().strip().splitlines()[-1], workers[0]


def test_a_killed_worker_stops_the_run_naming_it_and_resume_goes_on(folder, tmp_path):
    status, error, victim = _signal_a_worker_mid_run(folder, tmp_path, signal.SIGKILL)
    assert status == 2, (tmp_path / "stderr").read_text()[-3000:]
    named = re.match(
        rf"error: Grain worker [01] of 2 \(pid {victim}\) was killed by signal 9 \(SIGKILL\), "
        r"while the input needed it \(batch (\d+) was due\)",
        error,
    )
    assert named, error
    assert 0 < int(named[1]) < BATCHES_PER_EPOCH, "not killed in the middle of the first epoch"
    assert error.endswith("--resume goes on from the newest."), error

    # Every checkpoint written is whole, and the run goes on from the newest.
    checkpoints = tmp_path / "checkpoints"
    assert not [p.name for p in checkpoints.iterdir() if not p.name.isdigit()]
    last = _steps(checkpoints)[-1]
    resumed = _start_training(folder, tmp_path, "--steps", str(last + 5), "--resume")
    try:
        assert resumed.wait(timeout=600) == 0, (tmp_path / "stderr").read_text()[-3000:]
    finally:
        if resumed.poll() is None:
            os.killpg(resumed.pid, signal.SIGKILL)
            resumed.wait(timeout=60)
    assert "cannot be restored" not in (tmp_path / "stderr").read_text()
    assert f"trained {last + 5} steps" in (tmp_path / "stdout").read_text()
    assert _steps(checkpoints)[-1] > last


def test_a_stopped_worker_stops_the_run_after_the_input_timeout_naming_it(folder, tmp_path):
    status, error, victim = _signal_a_worker_mid_run(
        folder, tmp_path, signal.SIGSTOP, "--input-timeout", "5"
    )
    assert status == 2, (tmp_path / "stderr").read_text()[-3000:]
    # Worker w prepares the batches w, w + 2, ...: the batch awaited is the stopped worker's.
    owed = re.match(
        r"error: No input batch came within 5 s: batch (\d+) of \d+, prepared by "
        rf"Grain worker (\d) of 2 \(pid {victim}, stopped\)",
        error,
    )
    assert owed, error
    assert int(owed[2]) == int(owed[1]) % 2
    assert "--input-timeout SECONDS sets the timeout." in error
