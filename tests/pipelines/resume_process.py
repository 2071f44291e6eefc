"""Restores a Grain input iterator from an orbax checkpoint and saves the batches after it.

Run by test_resume.py in a fresh process:

    python resume_process.py '{"data": [...], "checkpoint": ..., "out": ..., "workers": 2}'

The pipeline settings are those of `pipeline(...)`, shared with the test.
"""

import json
import sys

import grain
import orbax.checkpoint as ocp
import pipeline_cases as cases

import pipelines

BATCH = 16


def pipeline(data, workers: int) -> pipelines.HostIterator:
    """The pipeline the test checkpoints and this script restores."""
    return pipelines.make_grain_iterator(
        data,
        batching=pipelines.BatchingConfig(global_batch_size=BATCH, num_epochs=2, shuffle_seed=11),
        preprocess=cases.preprocess_config(BATCH, local_devices=8, global_devices=8, partitions=1),
        options=pipelines.GrainOptions(worker_count=workers),
    )


def checkpointer() -> ocp.Checkpointer:
    return ocp.Checkpointer(grain.checkpoint.CheckpointHandler())


def main(args: dict) -> None:
    with pipeline(args["data"], args["workers"]) as iterator:
        checkpointer().restore(
            args["checkpoint"], args=grain.checkpoint.CheckpointRestore(iterator)
        )
        cases.save_batches(args["out"], [cases.flat(batch) for batch in iterator])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
