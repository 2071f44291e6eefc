"""A checkpoint's arrays written in chunks and restored a chunk at a time into
their shards (`sparseflow._array_blocks`), against the arrays saved."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from memory_maps import status_bytes

from sparseflow import _array_blocks

# Chunks of a few kilobytes, so that small arrays are read in many blocks.
SMALL_CHUNK = 4096


def _save(directory, arrays, **handler_options) -> epath.Path:
    path = epath.Path(directory)
    handler = ocp.PyTreeCheckpointHandler(use_compression=False, **handler_options)
    handler.save(path, args=_array_blocks.save_args(arrays))
    handler.finalize(path)
    return path


def _abstract(arrays):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), arrays
    )


def _arrays() -> dict:
    """Arrays of the shapes and shardings a run saves, none a multiple of a chunk."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    rows = NamedSharding(mesh, PartitionSpec("x"))
    rng = np.random.default_rng(0)
    return {
        "one_device": jnp.asarray(rng.normal(size=(1003, 16)), jnp.float32),
        "by_rows": jax.device_put(rng.normal(size=(1000, 16)).astype(np.float32), rows),
        "per_row": jax.device_put(rng.normal(size=(1000,)).astype(np.float32), rows),
        "awkward": jnp.asarray(rng.normal(size=(2 * 1009, 16)), jnp.float32),  # 2 x a prime rows
        "replicated": jax.device_put(
            np.arange(10, dtype=np.float32), NamedSharding(mesh, PartitionSpec())
        ),
        "counts": jnp.asarray(rng.integers(0, 9, size=(777,)), jnp.int32),
        "scalar": jnp.float32(3.5),
    }


def test_the_arrays_restore_bitwise_in_their_shardings(tmp_path, monkeypatch):
    monkeypatch.setattr(_array_blocks, "CHUNK_BYTES", SMALL_CHUNK)
    arrays = _arrays()
    # An empty node, as optax's states hold: no array of its own.
    path = _save(tmp_path / "arrays", {**arrays, "empty": optax.EmptyState()}, use_zarr3=True)
    stored = ocp.PyTreeCheckpointHandler().metadata(path).tree
    # The case: arrays stored in many chunks, shards cut across chunks; and
    # rows with no divisor near a chunk stored a chunk per shard.
    assert stored["one_device"].storage.chunk_shape == (59, 16)  # 1003 = 17 x 59
    assert stored["by_rows"].storage.chunk_shape == (50, 16)  # shards of 250 rows
    assert stored["awkward"].storage.chunk_shape == (2018, 16)
    restored = _array_blocks.restore(path, {**_abstract(arrays), "empty": optax.EmptyState()})
    assert restored.pop("empty") == optax.EmptyState()
    for name, array in arrays.items():
        assert restored[name].sharding == array.sharding, name
        assert restored[name].dtype == array.dtype, name
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(array), err_msg=name)


def test_chunks_cut_along_any_dimension_are_read_into_place(tmp_path, monkeypatch):
    """Files of other writers: orbax's own choice of chunks cuts a wide array's columns."""
    monkeypatch.setattr(_array_blocks, "CHUNK_BYTES", SMALL_CHUNK)
    wide = {"wide": jnp.asarray(np.random.default_rng(1).normal(size=(24, 3000)), jnp.float32)}
    path = epath.Path(tmp_path / "arrays")
    handler = ocp.PyTreeCheckpointHandler(use_compression=False, use_zarr3=True)
    chunks = {"wide": ocp.SaveArgs(chunk_byte_size=SMALL_CHUNK)}
    handler.save(path, args=ocp.args.PyTreeSave(wide, save_args=chunks))
    handler.finalize(path)
    assert handler.metadata(path).tree["wide"].storage.chunk_shape[1] < 3000  # the case
    restored = _array_blocks.restore(path, _abstract(wide))
    np.testing.assert_array_equal(np.asarray(restored["wide"]), np.asarray(wide["wide"]))


@pytest.mark.parametrize(
    ("rows", "chunk_rows"),
    [
        (100_000_000, 1_000_000),  # 64 MB chunks of 16 floats a row
        (8_000_024, 1_000_003),  # 8 x 1,000,003: a divisor just under a chunk
        (10_000_024, None),  # 8 x 1,250,003 (prime): 8-row chunks otherwise
        (1_000_000, None),  # fits one chunk
    ],
)
def test_chunks_are_whole_rows_dividing_the_shard(rows, chunk_rows):
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    table = jax.ShapeDtypeStruct((rows, 16), jnp.float32, sharding=one_device)
    expected = None if chunk_rows is None else chunk_rows * 16 * 4
    assert _array_blocks.chunk_byte_size(table) == expected


def test_arrays_stored_whole_are_left_to_orbax(tmp_path):
    """An earlier version's checkpoint (zarr2, a chunk a shard): not read here."""
    arrays = {"t": jnp.ones((100, 16), jnp.float32)}
    path = _save(tmp_path / "arrays", arrays, use_zarr3=False)
    assert _array_blocks.restore(path, _abstract(arrays)) is None


def test_an_array_of_another_shape_is_refused_by_name(tmp_path):
    arrays = {"table": jnp.ones((100, 16), jnp.float32)}
    path = _save(tmp_path / "arrays", arrays, use_zarr3=True)
    wrong = {
        "table": jax.ShapeDtypeStruct((100, 8), jnp.float32, sharding=arrays["table"].sharding)
    }
    with pytest.raises(ValueError, match=r"'table'.*float32\[100, 16\].*float32\[100, 8\]"):
        _array_blocks.restore(path, wrong)


@pytest.mark.parametrize("rows", [2**19, 2**22], ids=["one chunk", "many chunks"])
def test_a_restored_array_is_donated_in_place(tmp_path, rows):
    """Its buffer is the device's own: a step that donates it updates it where it
    is (a buffer aliasing host memory read from the files would be copied)."""
    arrays = {"table": jnp.ones((rows, 16), jnp.float32)}
    path = _save(tmp_path / "arrays", arrays, use_zarr3=True)
    abstract = _abstract(arrays)
    del arrays
    table = _array_blocks.restore(path, abstract)["table"]
    # Compiled first: the compiler's memory is not the step's.
    step = jax.jit(lambda t: t.at[0].add(1.0), donate_argnums=0).lower(table).compile()
    before = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again here
    table = jax.block_until_ready(step(table))
    grown = status_bytes("VmHWM") - before
    assert float(table[0, 0]) == 2.0
    assert grown < 0.25 * rows * 16 * 4, grown / (rows * 16 * 4)
