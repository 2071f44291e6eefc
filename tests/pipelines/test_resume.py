"""Exact resume: an input iterator checkpointed with orbax continues, in a new process,
with the batches an uninterrupted run produces (pipelines/_host_iterator.py, _device.py)."""

import json
import os
import subprocess
import sys

import grain
import jax
import pipeline_cases as cases
import pytest
import resume_process

import pipelines

TIMEOUT_S = 240


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return cases.write_dataset(str(tmp_path_factory.mktemp("resume")), 70)["arrayrecord"]


def test_a_checkpointed_device_iterator_resumes_exactly_in_a_new_process(data, tmp_path):
    # The uninterrupted run prepares batches in this process; the checkpointed
    # and the resumed runs in two worker processes each: all three must agree.
    with resume_process.pipeline(data, workers=0) as iterator:
        uninterrupted = [cases.flat(batch) for batch in iterator]
    assert len(uninterrupted) == 2 * (70 // resume_process.BATCH)

    # Two worker processes, and batches prefetched onto the devices beyond
    # the three the loop takes: the checkpoint must hold the loop's position.
    mesh = jax.sharding.Mesh(jax.devices(), ("x",))
    host = resume_process.pipeline(data, workers=2)
    with pipelines.DeviceIterator(host, mesh, buffer_size=3) as batches:
        taken = [cases.flat(next(batches)) for _ in range(3)]
        checkpoint = tmp_path / "input"
        resume_process.checkpointer().save(
            checkpoint, args=grain.checkpoint.CheckpointSave(batches)
        )
    cases.assert_batches_equal(taken, uninterrupted[:3])

    out = tmp_path / "resumed.npz"
    args = {"data": data, "checkpoint": str(checkpoint), "out": str(out), "workers": 2}
    subprocess.run(
        [sys.executable, resume_process.__file__, json.dumps(args)],
        check=True,
        timeout=TIMEOUT_S,
        cwd=os.path.dirname(resume_process.__file__),
    )
    cases.assert_batches_equal(cases.load_batches(str(out)), uninterrupted[3:])
