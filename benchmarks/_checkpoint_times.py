"""Saving and restoring a pytree of arrays through the trainer's own checkpoints
(`sparseflow._checkpoint`, orbax), timed, with the peak resident memory of each,
for `benchmarks/scale.py`'s step processes (every process of a group calls
them together; each reports its own memory).

The caller drops the arrays between the two, as a resumed run has nothing but
the checkpoint; a checksum of their bits, taken once the save has returned
(outside the save's timing and peak: it is the benchmark's own check), must
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
import numpy as np
from _memory import reset_peak, resident_bytes

from sparseflow import _hosts
from sparseflow._checkpoint import Checkpoints, Snapshot, abstract_like

_RUN = {"benchmark": "scale"}


# Elements of a shard weighed at once by `checksum`: its temporaries stay small.
_CHECKSUM_ELEMENTS = 2**20


def checksum(tree: Any) -> int:
    """The bits of every float32 array, each weighted by one more than its flat
    position modulo 65521, summed modulo 2**32 (a moved or changed value shows).

    Each process weighs the shards it holds, a block of rows at a time on
    their devices, and the processes' sums are added: one jitted sum over
    whole arrays held a temporary as large as the arrays.
    """
    total = 0
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            if shard.replica_id == 0:
                first = (shard.index[0].start or 0) if x.ndim else 0
                total += int(_shard_sum(shard.data, np.uint32(first)))
    mine = np.array([total % 2**32], np.uint32)
    if jax.process_count() == 1:
        return int(mine[0])
    return int(np.asarray(_hosts.gathered(mine), np.uint64).sum() % 2**32)


@jax.jit
def _shard_sum(shard: jax.Array, first_row: jax.Array) -> jax.Array:
    """`uint32[]`: `checksum`'s sum over one shard whose first row is `first_row` of its array."""
    values = shard.reshape(shard.shape[0] if shard.ndim else 1, -1)
    rows, columns = values.shape
    block = max(1, min(rows, _CHECKSUM_ELEMENTS // max(columns, 1)))

    def add_block(i, total):
        # The last block is moved back to fit; rows an earlier block weighed are left out.
        start = jnp.minimum(i * block, rows - block)
        part = jax.lax.dynamic_slice_in_dim(values, start, block, 0)
        part = jax.lax.bitcast_convert_type(part.astype(jnp.float32), jnp.uint32)
        row = start + jax.lax.broadcasted_iota(jnp.int32, part.shape, 0)
        flat = (first_row + row.astype(jnp.uint32)) * np.uint32(columns)
        flat = flat + jax.lax.broadcasted_iota(jnp.uint32, part.shape, 1)
        weighted = jnp.where(row >= i * block, part * (flat % 65521 + 1), 0)
        return total + jnp.sum(weighted, dtype=jnp.uint32)

    return jax.lax.fori_loop(0, -(-rows // block), add_block, jnp.uint32(0))


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
    checkpoints = Checkpoints(folder, run=_RUN, keep=1)
    reset_peak()
    began = time.perf_counter()
    checkpoints.save(Snapshot(step=1, arrays=arrays, iterator_state=b"", metadata={}))
    saved = time.perf_counter()
    os.sync()
    synced = time.perf_counter()
    peak = resident_bytes()["peak_rss"]
    checkpoints.close()
    total = checksum(arrays)
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
    if checksum(arrays) != total:
        raise RuntimeError(f"the arrays restored from {folder} are not the ones saved")
    _hosts.barrier("scale:checkpoint_restored")
    if jax.process_index() == 0:
        shutil.rmtree(folder)
    return {"restore_s": round(restore_s, 3), "peak_rss_restore": peak}, arrays
