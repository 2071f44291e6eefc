"""Saves a step into a checkpoint folder again and dies while orbax writes it.

Run by test_checkpoints.py in a fresh process:

    python checkpoint_process.py DIRECTORY STEP VALUE
"""

import os
import sys

import orbax.checkpoint as ocp
from test_checkpoints import RUN, _snapshot

from sparseflow._checkpoint import Checkpoints


def _die(*args, **kwargs):
    os._exit(0)  # a crash: no cleanup, no flushing


def main(directory: str, step: int, value: float) -> None:
    checkpoints = Checkpoints(directory, run=RUN)
    # Orbax's finalize step renames the written temporary folder to the step:
    # dying there leaves the save written but not committed.
    ocp.CheckpointManager._finalize = _die
    checkpoints.save(_snapshot(step, value))
    raise AssertionError("the save returned before it could be interrupted")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
