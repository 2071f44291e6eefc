"""A run whose loss stops being finite stops, and its last checkpoint stays its last good one."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

import pipelines
from pipelines._parse import DENSE_KEY
from pipelines._records import RecordFileWriter
from sparseflow import _train
from sparseflow._checkpoint import Checkpoints

BATCH = 512
BAD_BATCH = 5


# A finite dense value the dense tower overflows on. A NaN or infinite value
# never reaches the model: the parser rejects its record as bad.
_HUGE = 3.0e38


def _with_huge_dense(data: str, out: Path, record_index: int) -> str:
    """A copy of the ArrayRecord files of `data` with huge dense values in one record."""
    out.mkdir()
    index = 0
    for path in pipelines.list_record_files(data):
        with RecordFileWriter(out / Path(path).name) as writer:
            for record in pipelines.read_records(path):
                if index == record_index:
                    example = tf.train.Example.FromString(record)
                    dense = example.features.feature[DENSE_KEY].float_list.value
                    dense[:] = [_HUGE] * len(dense)
                    record = example.SerializeToString()
                writer.write(record)
                index += 1
    return str(out)


def _finite(tree) -> bool:
    return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree))


def test_an_overflowing_input_stops_training_and_keeps_the_last_good_checkpoint(small_run):
    tmp, _, config, data = small_run
    # Unshuffled, record r is in global batch r // BATCH.
    config = dataclasses.replace(
        config, training=dataclasses.replace(config.training, shuffle=False)
    )
    bad_data = _with_huge_dense(data, tmp / "huge_data", BAD_BATCH * BATCH + 3)
    checkpoints = tmp / "diverged"
    options = _train.TrainOptions(
        data=bad_data, steps=8, pipelined=False, progress=False, checkpoint_dir=checkpoints
    )
    with pytest.raises(
        _train.TrainingDivergedError,
        match=rf"loss of step {BAD_BATCH + 1} \(global batch {BAD_BATCH} of the input\) "
        r"is (nan|inf).*"
        rf"the dataset's records {BAD_BATCH * BATCH}-{(BAD_BATCH + 1) * BATCH - 1} \(",
    ):
        _train.train(config, options)

    run = _train._Run(config, options, _train.make_mesh(config.mesh.devices))
    saved = Checkpoints(checkpoints, run=None)
    try:
        steps = saved.steps()
        last = saved.restore_latest(run.arrays())
    finally:
        saved.close()
    # Step 6, which trains batch 5, is not saved.
    assert steps == [2, 4]
    assert len(last.metadata["losses"]) == 4
    assert all(math.isfinite(loss) for loss in last.metadata["losses"])
    assert _finite((last.arrays["state"], last.arrays["tables"]))


def _run(small_run, *, pipelined: bool) -> _train._Run:
    _, _, config, data = small_run
    options = _train.TrainOptions(data=data, pipelined=pipelined)
    return _train._Run(config, options, _train.make_mesh(config.mesh.devices))


def _assert_not_saved(run: _train._Run, folder: Path) -> None:
    checkpoints = Checkpoints(folder, run=None)
    try:
        with pytest.raises(_train.TrainingDivergedError, match="NaN or infinite after step 3"):
            _train._save(run, checkpoints, batches=None, done=3)
        assert checkpoints.steps() == []
    finally:
        checkpoints.close()


def test_non_finite_parameters_are_not_saved(small_run):
    run = _run(small_run, pipelined=False)
    name, variables = next(iter(run.tables.items()))
    run.tables = dict(run.tables, **{name: variables._replace(table=variables.table * np.inf)})
    _assert_not_saved(run, small_run[0] / "non_finite")


def test_non_finite_values_in_flight_are_not_saved(small_run):
    """A pipelined run's state in flight (here a NaN gradient) is checked too:
    the next step would apply it to the restored parameters."""
    run = _run(small_run, pipelined=True)
    run.pipeline_state = {"gradients": jnp.array([1.0, np.nan]), "step": jnp.array(3)}
    _assert_not_saved(run, small_run[0] / "non_finite_in_flight")


@pytest.mark.parametrize(
    ("indices", "text"),
    [
        ([7], "7"),
        ([3, 1, 2, 9], "1-3, 9"),
        (list(range(0, 40, 2)), "0, 2, 4, 6, 8, 10, 12, 14, ..."),
    ],
)
def test_record_ranges(indices, text):
    assert _train._ranges(np.array(indices)) == text
