"""One of two processes saving checkpoints together, then restoring the newest.

Run by test_checkpoints.py, twice at once, in fresh processes with 4 CPU devices each:

    python checkpoint_hosts_process.py DIRECTORY PROCESS_ID COORDINATOR

Process 1 cannot read step 4 (its arrays' handler fails there, as on a
damaged file only it reads). Prints what it restored as JSON.
"""

import json
import sys
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sparseflow import _array_blocks, _launch
from sparseflow._checkpoint import Checkpoints, Snapshot

RUN = {"tables": {"users": {"vocabulary_size": 100}}}
_read = _array_blocks.restore


def _damaged_step_4(directory, *args, **kwargs):
    if Path(directory).parent.name == "4":
        raise OSError(f"{directory} is truncated")
    return _read(directory, *args, **kwargs)


def _arrays(value: float) -> dict:
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("devices",)), PartitionSpec("devices"))
    full = np.full((8, 4), value, np.float32)
    return {"w": jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])}


def main(directory: str, process_id: int, coordinator: str) -> None:
    _launch.initialize_distributed(coordinator, 2, process_id)
    checkpoints = Checkpoints(directory, run=RUN)
    for step in (2, 4):
        position = f"step {step} of process {process_id}".encode()
        checkpoints.save(Snapshot(step, _arrays(step), position, {}))
    if process_id == 1:
        _array_blocks.restore = _damaged_step_4
    snapshot = checkpoints.restore_latest(_arrays(0))
    checkpoints.close()
    shard = snapshot.arrays["w"].addressable_shards[0].data
    print(
        json.dumps(
            {
                "step": snapshot.step,
                "position": snapshot.iterator_state.decode(),
                "value": float(np.asarray(shard).max()),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
