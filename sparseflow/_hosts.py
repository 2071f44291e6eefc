"""Agreement between the processes of a run: every process calls each function, in the same order.

Each is a collective over all processes (one process: no communication).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def all_true(flag: bool) -> bool:
    """Whether `flag` holds on every process."""
    if jax.process_count() == 1:
        return flag
    flags = multihost_utils.process_allgather(np.array([flag], dtype=np.int32))
    return bool(np.all(flags))


def gathered(values: np.ndarray) -> np.ndarray:
    """`int32[processes, k]`: every process's `int32[k]` `values`, in process order."""
    return np.asarray(multihost_utils.process_allgather(values)).reshape(jax.process_count(), -1)


def same_everywhere(value: Any) -> bool:
    """Whether every process holds this JSON-able `value`."""
    if jax.process_count() == 1:
        return True
    digest = hashlib.sha256(json.dumps(value, sort_keys=True).encode()).digest()
    # Without x64, JAX arrays hold 32-bit integers: four bytes of the digest.
    mine = np.frombuffer(digest[:4], dtype=np.uint32)
    every = np.asarray(multihost_utils.process_allgather(mine))
    return bool(np.all(every == mine))


def barrier(name: str) -> None:
    """Returns once every process has reached the barrier `name`."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
