"""A checkpoint's arrays written in chunks and read back a chunk at a time.

Orbax reads each shard of an array whole into host memory before it puts it
on its device: from files that hold a shard as one chunk (what it writes
by default) a resumed run held about twice its tables, and a table that
trains in memory could not be resumed in it. Where `jax.device_put` aliases
the host array instead (an aligned one, on CPU), the first step that
donates it copies it, twice the tables again. So the trainer writes every
large array in chunks of at most `CHUNK_BYTES` (zarr3 in orbax's OCDBT
store; `save_args`), and `restore` reads each shard a chunk at a time into a
buffer of the device's own (zeros, then donated updates in place): beyond
the arrays it holds about two chunks.
"""

from __future__ import annotations

import functools
import itertools
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

# The most a stored chunk holds, so the most a restore reads at once: a small
# part of a large table, and large enough that reading by chunks costs no
# more than reading whole (docs/benchmarks.md).
CHUNK_BYTES = 64 * 2**20


def handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's handler of the arrays as `save` writes them.

    Uncompressed: tables and slots hardly compress, and compressing them held
    every encoded array in memory at once: a save's peak was about twice the
    arrays, and it was several times slower (docs/benchmarks.md).
    """
    return ocp.PyTreeCheckpointHandler(use_compression=False, use_zarr3=True)


def save_args(arrays: Any) -> ocp.args.PyTreeSave:
    """What `handler()` saves `arrays` by: each array in chunks of `chunk_byte_size(array)`.

    OCDBT's data files are left unbounded: orbax otherwise chunks any shard
    over 2 GB, by its own choice of divisor.
    """
    return ocp.args.PyTreeSave(
        arrays,
        save_args=jax.tree.map(lambda x: ocp.SaveArgs(chunk_byte_size=chunk_byte_size(x)), arrays),
        ocdbt_target_data_file_size=0,
    )


def chunk_byte_size(array: jax.Array) -> int | None:
    """The size of the chunks to store `array` in: whole rows, the most that fit
    `CHUNK_BYTES` and divide a shard's rows (orbax cuts chunks within shards);
    None, a chunk per shard, where a shard fits `CHUNK_BYTES`, or where no
    divisor of its rows makes a chunk of a sixteenth of that (a table of 8 x
    a prime rows would be stored and read 8 rows at a time)."""
    shard = array.sharding.shard_shape(array.shape)
    nbytes = math.prod(shard) * np.dtype(array.dtype).itemsize
    if not shard or nbytes <= CHUNK_BYTES:
        return None
    row_bytes = nbytes // shard[0]
    rows = _largest_divisor_at_most(shard[0], CHUNK_BYTES // row_bytes)
    return rows * row_bytes if rows * row_bytes * 16 >= CHUNK_BYTES else None


def _largest_divisor_at_most(n: int, bound: int) -> int:
    """The largest divisor of `n` that is at most `bound` (0 where `bound` < 1)."""
    best = 0
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            best = max([best] + [x for x in (d, n // d) if x <= bound])
    return best


def restore(directory: Path, abstract: Any) -> Any | None:
    """The arrays of `abstract` (shapes, dtypes, shardings) from an orbax PyTree item.

    Returns:
      The arrays, or None where the item's arrays are not stored in chunks
      (zarr2: written before `save_args`; orbax's restore reads those).

    Raises:
      ValueError: an array's stored shape or dtype is not `abstract`'s.
      Exception: what TensorStore raises for a missing or damaged array.
    """
    metadata = ocp.PyTreeCheckpointHandler().metadata(epath.Path(directory))
    if not metadata.use_zarr3:
        return None
    context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
    return jax.tree.map(
        lambda like, name: _restore_array(Path(directory), name, like, context),
        abstract,
        ocp.tree.get_param_names(abstract, include_empty_nodes=False),
    )


def _restore_array(directory: Path, name: str, like: jax.ShapeDtypeStruct, context) -> jax.Array:
    info = ocp.type_handlers.ParamInfo(
        name=name,
        parent_dir=epath.Path(directory),
        is_ocdbt_checkpoint=True,
        use_zarr3=True,
        ts_context=context,
    )
    spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=True)
    store = ts.open(spec, open=True, read=True, context=context).result()
    if tuple(store.shape) != tuple(like.shape) or store.dtype.numpy_dtype != like.dtype:
        raise ValueError(
            f"Array {name!r} in {directory} is {store.dtype.numpy_dtype}{list(store.shape)}, "
            f"not the {np.dtype(like.dtype)}{list(like.shape)} it is restored as."
        )
    chunk = store.chunk_layout.read_chunk.shape
    shards = [
        _read_shard(store[index] if index else store, chunk, device)
        for device, index in like.sharding.addressable_devices_indices_map(like.shape).items()
    ]
    return jax.make_array_from_single_device_arrays(like.shape, like.sharding, shards)


def _read_shard(region: ts.TensorStore, chunk: tuple, device) -> jax.Array:
    """`region` (a shard of the stored array) on `device`, read a chunk at a time."""
    nbytes = math.prod(region.shape) * region.dtype.numpy_dtype.itemsize
    if nbytes <= CHUNK_BYTES:
        # Copied on the device: `device_put` aliases an aligned host array on
        # CPU, and a step cannot donate an aliased buffer (it copies it).
        return jax.numpy.copy(jax.device_put(region.read().result(), device))
    shard = jax.numpy.zeros(region.shape, region.dtype.numpy_dtype, device=device)
    origin = region.domain.inclusive_min
    for box in itertools.product(*map(_chunk_spans, origin, region.domain.exclusive_max, chunk)):
        block = _read_block(region, box, device)
        shard = _put_block(shard, block, tuple(a - o for (a, _), o in zip(box, origin)))
    return shard


def _chunk_spans(first: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """`[first, end)` cut where the stored chunks of size `chunk` (from 0) meet."""
    cuts = [first, *range((first // chunk + 1) * chunk, end, chunk), end]
    return list(zip(cuts[:-1], cuts[1:]))


def _read_block(region: ts.TensorStore, box: tuple, device) -> jax.Array:
    """The part `box` (`(start, end)` per dimension) of `region` on `device` (the
    host copy is gone on return)."""
    return jax.device_put(region[tuple(slice(a, b) for a, b in box)].read().result(), device)


@functools.partial(jax.jit, donate_argnums=0)
def _put_block(shard: jax.Array, block: jax.Array, start: tuple) -> jax.Array:
    """`shard` with `block` at `start` (in place: `shard` is donated)."""
    return jax.lax.dynamic_update_slice(shard, block, start)
