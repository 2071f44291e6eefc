"""A small copy of the demo config, its data, and the command line, for the training tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import yaml

import pipelines
from sparseflow import _train, shipped_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = 5120
# JAX's log line for each compilation of the pipelined step (`jax.log_compiles`).
STEP_COMPILED = "Finished XLA compilation of jit(pipelined_step)"


def small_demo_config(tmp: Path, training: dict, name: str = "config.yaml", **top) -> Path:
    """The demo config with its dataset in `tmp`, the given training section and top-level keys."""
    raw = yaml.safe_load(shipped_config("demo").read_text())
    raw["dataset"] = {"dir": str(tmp / "data")}
    raw["synthetic"].update(examples=EXAMPLES, eval_examples=1024)
    raw["training"] = training
    # Without FDO buffer sizes, minibatching reserves room for 64 minibatches
    # at the configured limits; these runs need no minibatching.
    raw["preprocessing"]["enable_minibatching"] = False
    raw.update(top)
    path = tmp / name
    path.write_text(yaml.safe_dump(raw))
    return path


def write_data(config, out: Path, *, examples: int = EXAMPLES, seed: int | None = None) -> str:
    """The config's synthetic ArrayRecord data in `out`; returns its directory."""
    pipelines.write_synthetic_dataset(
        config.synthetic.dataset,
        out,
        num_examples=examples,
        seed=config.seed if seed is None else seed,
        num_shards=2,
        formats=("arrayrecord",),
    )
    return str(out / "arrayrecord")


def cli(*args: str, timeout: float = 600, preexec_fn=None) -> subprocess.CompletedProcess:
    """`python -m sparseflow ARGS` from the repository, its output captured.

    It runs in a session of its own: on a timeout its local processes are
    killed with it, not left running. `preexec_fn` runs in the child before
    the interpreter starts (e.g. to set a resource limit).
    """
    process = subprocess.Popen(
        [sys.executable, "-m", "sparseflow", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        start_new_session=True,
        preexec_fn=preexec_fn,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def assert_bitwise_equal_runs(result, reference) -> None:
    """Two `TrainResult`s with the same losses, dense state, tables and slots, bitwise."""
    assert result.losses == reference.losses
    for a, b in zip(
        jax.tree.leaves((result.train_state, result.embedding_variables)),
        jax.tree.leaves((reference.train_state, reference.embedding_variables)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def assert_resume_is_exact(config, checkpoints: Path, **options) -> None:
    """Trains 4 steps whole, and 2 with checkpoints then resumed to 4, unpipelined:
    the two runs end bitwise equal (`options`: more of `_train.TrainOptions`).

    Unpipelined only: a pipelined run that ends drains the batches in flight,
    so its resume continues another schedule than the whole run's; a
    pipelined resume is tested after a crash (`--stop-after`).
    """
    options = dict(options, pipelined=False)
    whole = _train.train(config, _train.TrainOptions(**options, steps=4))
    _train.train(config, _train.TrainOptions(**options, steps=2, checkpoint_dir=checkpoints))
    resumed = _train.train(
        config, _train.TrainOptions(**options, steps=4, checkpoint_dir=checkpoints, resume=True)
    )
    assert_bitwise_equal_runs(resumed, whole)
