"""Two hosts, one of which alone breaks the limits: both minibatch, as one pass would train.

The data hold one global batch whose first half (host 0's rows) packs many
ids into one partition of the `items` table, beyond the small limits, while
its second half (host 1's rows) stays under them. Run A trains with those
small limits and minibatching; run B with limits large enough for a single
pass and minibatching off. Minibatching splits the table's rows, never a
row, so both runs must end with the same tables and dense parameters; if the
hosts split the batch differently, the step would not see one consistent
batch and the runs would differ (or the step would fail).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

import embedding
import pipelines
from embedding import RaggedIds
from pipelines._parse import serialize_examples
from pipelines._records import RecordFileWriter
from sparseflow import load_config
from sparseflow._checkpoint import Checkpoints
from sparseflow._train import TrainOptions, _Run, make_mesh

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
BATCH = 64
DEVICES = 8
# The global batch whose host-0 half breaks the small limits.
CROWDED_BATCH = 1
# Host 0's rows of a global batch: the first half (host h reads rows
# [h * B/2, (h + 1) * B/2) of each global batch).
HOST_ROWS = BATCH // 2
# Crowded rows hold 12 ids, all multiples of 8 and so all in partition 0 of
# 8; rows alternate between two sets of 12. A device's slot of 8 rows then
# holds 96 entries of 24 distinct ids in that partition.
CROWDED_VALENCY = 12
# The filler data holds at most 2 ids per row: a slot of 8 rows holds at most
# 16 entries (16 distinct) per partition, under the small limits.
FILLER_VALENCY = 2
SMALL_LIMITS = (16, 16)  # (max_ids, max_unique_ids) per partition
SINGLE_PASS_LIMITS = (128, 128)
RUN_TIMEOUT_S = 240


def _config(tmp: Path, name: str, *, limits: tuple[int, int], minibatching: bool) -> Path:
    """A two-table config (8 devices x 1 partition, batch 64) with `items` limits `limits`."""
    max_ids, max_unique = limits
    raw = {
        "name": name,
        "seed": 0,
        "mesh": {"devices": DEVICES, "partitions_per_device": 1},
        "global_batch_size": BATCH,
        "preprocessing": {"enable_minibatching": minibatching},
        "tables": [
            {
                "name": "items",
                "vocabulary_size": 1024,
                "embedding_dim": 8,
                "combiner": "sum",
                "optimizer": {
                    "type": "adagrad",
                    "learning_rate": 0.1,
                    "initial_accumulator_value": 0.1,
                },
                "initializer": {"type": "truncated_normal", "stddev": 0.05},
                "max_ids_per_partition": max_ids,
                "max_unique_ids_per_partition": max_unique,
            },
            {
                "name": "users",
                "vocabulary_size": 512,
                "embedding_dim": 4,
                "combiner": "sum",
                "optimizer": {"type": "sgd", "learning_rate": 0.1},
                "initializer": {"type": "uniform", "scale": 0.05},
                "max_ids_per_partition": 8,
                "max_unique_ids_per_partition": 8,
            },
        ],
        "features": [
            {"name": "clicked_items", "table": "items"},
            {"name": "user_id", "table": "users"},
        ],
        "dense_features": 4,
        "dataset": {"dir": str(tmp / "data")},
        "synthetic": {
            "examples": STEPS * BATCH,
            "eval_examples": BATCH,
            "features": {
                "clicked_items": {"valency": [1, CROWDED_VALENCY]},
                "user_id": {"valency": [1, 1]},
            },
        },
        "training": {"pipelined": False, "shuffle": False, "checkpoint_every": 1000},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _crowded_row(row: int) -> list[int]:
    first = CROWDED_VALENCY * (row % 2)
    return [8 * (first + j) for j in range(CROWDED_VALENCY)]


def _replace_rows(ragged: RaggedIds, new_rows: dict[int, list[int]]) -> RaggedIds:
    splits = ragged.row_splits
    rows = [
        np.asarray(new_rows.get(r, ragged.values[splits[r] : splits[r + 1]]), np.int64)
        for r in range(len(splits) - 1)
    ]
    lengths = [len(row) for row in rows]
    return RaggedIds(np.concatenate(rows), np.concatenate([[0], np.cumsum(lengths)]))


def _write_data(config, tmp: Path) -> Path:
    """Synthetic filler records with host 0's half of `CROWDED_BATCH` replaced by crowded rows.

    Returns:
      The ArrayRecord file written.
    """
    filler = dataclasses.replace(
        config.synthetic.dataset,
        features=tuple(
            dataclasses.replace(f, max_valency=min(f.max_valency, FILLER_VALENCY))
            for f in config.synthetic.dataset.features
        ),
    )
    files = pipelines.write_synthetic_dataset(
        filler,
        tmp / "filler",
        num_examples=STEPS * BATCH,
        seed=config.seed,
        num_shards=1,
        formats=("arrayrecord",),
    )
    layout = config.layout
    batch = pipelines.parse_examples(list(pipelines.read_records(files["arrayrecord"])), layout)
    start = CROWDED_BATCH * BATCH
    crowded = {r: _crowded_row(r) for r in range(start, start + HOST_ROWS)}
    ids = dict(batch.ids, clicked_items=_replace_rows(batch.ids["clicked_items"], crowded))
    path = tmp / "data" / "part-00000-of-00001.array_record"
    path.parent.mkdir()
    with RecordFileWriter(path) as writer:
        for record in serialize_examples(batch._replace(ids=ids)):
            writer.write(record)
    return path


def _host_features(data: Path, layout, host: int) -> dict[str, RaggedIds]:
    """Host `host`'s rows of `CROWDED_BATCH`, as the pipeline reads them."""
    records = list(pipelines.read_records(str(data)))
    start = CROWDED_BATCH * BATCH + host * HOST_ROWS
    return pipelines.parse_examples(records[start : start + HOST_ROWS], layout).ids


class _ThisHostOnly:
    """An agreement of one host: what a host's own preprocessing asks for."""

    def all_reduce_bool(self, sync_key: int, value: bool) -> bool:
        return value

    def all_reduce_uint64(self, sync_key: int, value: int) -> int:
        return value


def _own_minibatches(config, features: dict[str, RaggedIds]) -> int:
    preprocessed, _ = embedding.preprocess_sparse_dense_matmul_input(
        features,
        None,
        dict(config.feature_specs),
        DEVICES // 2,
        DEVICES,
        num_sc_per_device=config.mesh.partitions_per_device,
        enable_minibatching=True,
        all_reduce_interface=_ThisHostOnly(),
    )
    return int(preprocessed.num_minibatches[0])


def _start_training(
    config_path: Path, data: Path, checkpoints: Path, processes: int = 2
) -> subprocess.Popen:
    """`sparseflow train` on `processes` local processes, in a session of its own
    (killed as a group)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sparseflow",
            "train",
            "--config",
            str(config_path),
            "--data",
            str(data),
            "--steps",
            str(STEPS),
            "--no-progress",
            "--num-processes",
            str(processes),
            "--checkpoint-dir",
            str(checkpoints),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        start_new_session=True,
    )


def _finish(process: subprocess.Popen, deadline: float) -> None:
    try:
        _, stderr = process.communicate(timeout=max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        pytest.fail(f"Training did not finish within {RUN_TIMEOUT_S} s: {process.args}")
    assert process.returncode == 0, stderr[-3000:]


def _stop(process: subprocess.Popen) -> None:
    """Ends a run still going, with its worker processes (they would outlive the launcher)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The directory, configs A (small limits, minibatching) and B (single pass), the data."""
    tmp = tmp_path_factory.mktemp("multihost_minibatching")
    path_a = _config(tmp, "small_limits", limits=SMALL_LIMITS, minibatching=True)
    path_b = _config(tmp, "single_pass", limits=SINGLE_PASS_LIMITS, minibatching=False)
    config_a = load_config(path_a)
    return tmp, path_a, path_b, _write_data(config_a, tmp)


@pytest.fixture(scope="module")
def runs(setup):
    """Configs A and B, the data, and the directory holding the runs' checkpoints:
    A and B on 2 processes, and A on 1 and on 4 (`checkpoints_a1`, `checkpoints_a4`)."""
    tmp, path_a, path_b, data = setup
    # All runs at once: most of their time is start-up and compilation.
    deadline = time.monotonic() + RUN_TIMEOUT_S
    processes = [
        _start_training(path, data, tmp / f"checkpoints_{name}", count)
        for path, name, count in (
            (path_a, "a", 2),
            (path_b, "b", 2),
            (path_a, "a1", 1),
            (path_a, "a4", 4),
        )
    ]
    try:
        for process in processes:
            _finish(process, deadline)
    finally:
        for process in processes:
            _stop(process)
    return load_config(path_a), load_config(path_b), data, tmp


def test_only_host_0_breaks_the_small_limits(setup):
    _, path_a, path_b, data = setup
    config_a, config_b = load_config(path_a), load_config(path_b)
    layout = config_a.layout
    host_0, host_1 = (_host_features(data, layout, host) for host in (0, 1))
    assert _own_minibatches(config_a, host_0) > 1
    assert _own_minibatches(config_a, host_1) == 1
    assert _own_minibatches(config_b, host_0) == 1


def _restore(config, data: Path, checkpoints: Path):
    run = _Run(config, TrainOptions(data=str(data)), make_mesh(config.mesh.devices))
    manager = Checkpoints(checkpoints, run=None)  # inspected, not resumed
    try:
        snapshot = manager.restore_latest(run.arrays())
    finally:
        manager.close()
    assert snapshot is not None, f"no checkpoint in {checkpoints}"
    return run.arrays(), snapshot


def _assert_same_run(snapshot, expected, rtol: float) -> None:
    assert snapshot.step == expected.step == STEPS
    np.testing.assert_allclose(snapshot.metadata["losses"], expected.metadata["losses"], rtol=rtol)
    leaves = jax.tree_util.tree_leaves_with_path(snapshot.arrays)
    leaves_expected = jax.tree.leaves(expected.arrays)
    assert len(leaves) == len(leaves_expected)
    for (where, a), b in zip(leaves, leaves_expected, strict=True):
        np.testing.assert_allclose(
            np.asarray(a),
            np.asarray(b),
            rtol=rtol,
            atol=rtol / 10,
            err_msg=jax.tree_util.keystr(where),
        )


def test_minibatched_run_trains_as_a_single_pass(runs):
    config_a, config_b, data, tmp = runs
    initial, minibatched = _restore(config_a, data, tmp / "checkpoints_a")
    _, single_pass = _restore(config_b, data, tmp / "checkpoints_b")
    _assert_same_run(minibatched, single_pass, rtol=1e-6)
    # The crowded ids were trained: the comparison is not between untouched tables.
    trained = np.asarray(minibatched.arrays["tables"]["items"].table)
    assert not np.allclose(trained, np.asarray(initial["tables"]["items"].table))


@pytest.mark.parametrize("processes", [1, 4])
def test_the_minibatched_run_ends_the_same_on_one_two_and_four_processes(runs, processes):
    """Every host's rows, limits and minibatch count agree however the batch is
    split over processes: one process (no agreement), or four (hosts 0 and 1
    break the limits, hosts 2 and 3 do not)."""
    config_a, _, data, tmp = runs
    _, two = _restore(config_a, data, tmp / "checkpoints_a")
    _, other = _restore(config_a, data, tmp / f"checkpoints_a{processes}")
    _assert_same_run(other, two, rtol=1e-5)
