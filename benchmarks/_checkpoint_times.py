"""Saving and restoring a pytree of arrays through the trainer's own checkpoints
(`sparseflow._checkpoint`, orbax), timed, with the peak resident memory of each,
for `benchmarks/scale.py`'s step processes (every process of a group calls
them together; each reports its own memory).

The caller drops the arrays between the two, as a resumed run has nothing but
the checkpoint; a checksum of their bits taken before the save must
match the restored arrays'.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from _memory import reset_peak, resident_bytes

from sparseflow import _hosts
from sparseflow._checkpoint import Checkpoints, Snapshot, abstract_like

_RUN = {"benchmark": "scale"}


@jax.jit
def checksum(tree: Any) -> jax.Array:
    """`uint32[]`: the bits of every float32 array, each weighted by one more than its
    position modulo 65521, summed with wrap-around (a moved or changed value shows)."""

    def one(x):
        bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32).reshape(-1)
        weights = (jnp.arange(bits.size, dtype=jnp.uint32) % 65521) + 1
        return jnp.sum(bits * weights, dtype=jnp.uint32)

    return sum(jax.tree.leaves(jax.tree.map(one, tree)), jnp.uint32(0))


def save(arrays: Any, folder: Path) -> tuple[dict, Any, int]:
    """Saves `arrays` as step 1 in `folder` (emptied first).

    Returns:
      `(figures, abstract arrays, checksum)`: `save_s` (until the save
      returns), `sync_s` (then until the written data is on disk),
      `checkpoint_bytes` (the files), `peak_rss_save` (bytes, the save's own
      peak); what `restore` takes.
    """
    if jax.process_index() == 0:
        shutil.rmtree(folder, ignore_errors=True)
    _hosts.barrier("scale:checkpoint_folder_emptied")
    like = abstract_like(arrays)
    total = int(checksum(arrays))
    checkpoints = Checkpoints(folder, run=_RUN, keep=1)
    reset_peak()
    began = time.perf_counter()
    checkpoints.save(Snapshot(step=1, arrays=arrays, iterator_state=b"", metadata={}))
    saved = time.perf_counter()
    os.sync()
    synced = time.perf_counter()
    peak = resident_bytes()["peak_rss"]
    checkpoints.close()
    figures = {
        "save_s": round(saved - began, 3),
        "sync_s": round(synced - saved, 3),
        "checkpoint_bytes": sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()),
        "peak_rss_save": peak,
    }
    return figures, like, total


def restore(folder: Path, like: Any, total: int) -> tuple[dict, Any]:
    """Restores what `save` wrote (the caller dropped the arrays first), then removes it.

    Returns:
      `(figures, arrays)`: `restore_s`, `peak_rss_restore` (bytes).

    Raises:
      RuntimeError: the restored arrays' checksum is not the saved ones'.
    """
    checkpoints = Checkpoints(folder, run=_RUN, keep=1)
    reset_peak()
    began = time.perf_counter()
    arrays = jax.block_until_ready(checkpoints.restore_latest(like).arrays)
    restore_s = time.perf_counter() - began
    peak = resident_bytes()["peak_rss"]
    checkpoints.close()
    if int(checksum(arrays)) != total:
        raise RuntimeError(f"the arrays restored from {folder} are not the ones saved")
    _hosts.barrier("scale:checkpoint_restored")
    if jax.process_index() == 0:
        shutil.rmtree(folder)
    return {"restore_s": round(restore_s, 3), "peak_rss_restore": peak}, arrays
