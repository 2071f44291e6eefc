"""The parts `benchmarks/scale.py` measures with: the checkpoint round trip and its
checksum, the scattered ids, and the resident-memory reading."""

import mmap

import _checkpoint_times
import _memory
import _zipf_batches
import jax
import jax.numpy as jnp
import numpy as np
import pytest


def _arrays():
    rng = np.random.default_rng(0)
    return {
        "table": jnp.asarray(rng.normal(size=(64, 8)), jnp.float32),
        "slots": (jnp.asarray(rng.random(64), jnp.float32),),
    }


def test_the_checksum_sees_a_changed_bit_and_two_swapped_values():
    arrays = _arrays()
    total = int(_checkpoint_times.checksum(arrays))
    table = np.asarray(arrays["table"]).copy()
    assert int(_checkpoint_times.checksum(dict(arrays, table=jnp.asarray(table)))) == total
    flipped = table.copy()
    flipped.view(np.uint32)[3, 5] ^= 1
    assert int(_checkpoint_times.checksum(dict(arrays, table=jnp.asarray(flipped)))) != total
    swapped = table.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert int(_checkpoint_times.checksum(dict(arrays, table=jnp.asarray(swapped)))) != total


def test_a_save_and_restore_gives_back_the_arrays_and_leaves_no_files(tmp_path):
    arrays = _arrays()
    expected = jax.tree.map(np.asarray, arrays)
    saved, like, total = _checkpoint_times.save(arrays, tmp_path / "ckpt")
    assert saved["checkpoint_bytes"] > 0 and saved["peak_rss_save"] > 0
    restored_figures, restored = _checkpoint_times.restore(tmp_path / "ckpt", like, total)
    assert restored_figures["restore_s"] > 0
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored), expected)
    assert not (tmp_path / "ckpt").exists()


def test_a_restore_that_differs_from_the_save_is_refused(tmp_path):
    _, like, total = _checkpoint_times.save(_arrays(), tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match="not the ones saved"):
        _checkpoint_times.restore(tmp_path / "ckpt", like, total + 1)


@pytest.mark.parametrize("vocabulary", [1000, 1_000_003])
def test_scattered_ids_are_the_same_ranks_permuted(vocabulary):
    kwargs = dict(tables=2, rows=64, vocabulary=vocabulary, zipf=1.1, max_valency=5)
    plain = _zipf_batches.make_batches(2, 7, **kwargs)
    scattered = _zipf_batches.make_batches(2, 7, scattered=True, **kwargs)
    for p, s in zip(plain, scattered, strict=True):
        for name in p:
            np.testing.assert_array_equal(p[name].row_splits, s[name].row_splits)
            ranks = p[name].values.astype(np.int64)
            np.testing.assert_array_equal(s[name].values, ranks * 2_654_435_761 % vocabulary)
    # A permutation: distinct ranks stay distinct.
    ranks = np.arange(vocabulary, dtype=np.int64)
    assert np.unique(ranks * _zipf_batches.SCATTER % vocabulary).size == vocabulary


def test_the_peak_resets_to_the_resident_size_and_grows_with_a_new_buffer():
    _memory.reset_peak()
    before = _memory.resident_bytes()
    assert before["peak_rss"] <= before["rss"] + (8 << 20)
    # Fresh pages (an allocator could hand back memory that is resident already).
    buffer = mmap.mmap(-1, 64 << 20)
    np.frombuffer(buffer, np.uint8)[::4096] = 1
    grown = _memory.resident_bytes()["peak_rss"]
    buffer.close()
    assert grown >= before["rss"] + (60 << 20)
