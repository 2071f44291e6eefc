"""Packing a batch's layout arrays into one buffer per device, and back."""

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import embedding
import pipelines

DEVICES = 8


@st.composite
def preprocessed_inputs(draw):
    """A PreprocessedInput-shaped pytree of random int32/float32 host arrays."""
    stacks = draw(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=4, unique=True))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def leaf(dtype):
        n = DEVICES * draw(st.integers(1, 12))
        if dtype == np.float32:
            # Any bit pattern must survive, NaN payloads and signed zeros included.
            return (
                rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32).view(np.float32)
            )
        return rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)

    return embedding.PreprocessedInput(
        embedding.SparseDenseMatmulInput(
            lhs_row_pointers={s: leaf(np.int32) for s in stacks},
            lhs_embedding_ids={s: leaf(np.int32) for s in stacks},
            lhs_sample_ids={s: leaf(np.int32) for s in stacks},
            lhs_gains={s: leaf(np.float32) for s in stacks},
        ),
        num_minibatches=leaf(np.int32)[:DEVICES],
    )


def _assert_same_bits(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a = np.asarray(a)
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(a.view(np.int32), e.view(np.int32))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(preprocessed_inputs())
def test_unpacking_on_the_host_rebuilds_every_array_bit_for_bit(preprocessed):
    packed = pipelines.pack(preprocessed, DEVICES)
    assert packed.data.dtype == np.int32 and packed.data.shape[0] == DEVICES
    _assert_same_bits(packed.unpack(), preprocessed)
    width = sum(leaf.size for leaf in jax.tree.leaves(preprocessed)) // DEVICES
    assert packed.data.shape[1] == -(-width // 16) * 16
    assert not packed.data[:, width:].any()


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 40))
def test_each_devices_row_is_placed_without_a_copy(width):
    """Rows start on 64-byte boundaries, which the CPU backend aliases on placement."""
    packed = pipelines.pack({"ids": np.arange(DEVICES * width, dtype=np.int32)}, DEVICES)
    assert all(row.ctypes.data % 64 == 0 for row in packed.data)
    rows = NamedSharding(Mesh(jax.devices(), ("x",)), PartitionSpec("x"))

    placed = jax.make_array_from_process_local_data(rows, packed.data)

    for shard in placed.addressable_shards:
        row = packed.data[jax.devices().index(shard.device)]
        assert shard.data.unsafe_buffer_pointer() == row.ctypes.data


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(preprocessed_inputs())
def test_unpacking_in_a_jitted_program_keeps_each_devices_share_on_it(preprocessed):
    mesh = Mesh(jax.devices(), ("x",))
    rows = NamedSharding(mesh, PartitionSpec("x"))
    packed = pipelines.pack(preprocessed, DEVICES)
    on_devices = pipelines.PackedInput(jax.device_put(packed.data, rows), packed.layout)
    unpack = jax.jit(lambda p: p.unpack())

    unpacked = unpack(on_devices)

    _assert_same_bits(unpacked, preprocessed)
    # Row sharding comes out of the program unasked, and nothing moves between devices.
    compiled = unpack.lower(on_devices).compile().as_text()
    for collective in ("all-gather", "all-to-all", "all-reduce", "collective-permute"):
        assert collective not in compiled
    for got, expected in zip(jax.tree.leaves(unpacked), jax.tree.leaves(preprocessed)):
        assert got.sharding.is_equivalent_to(rows, got.ndim)
        share = expected.shape[0] // DEVICES
        for shard in got.addressable_shards:
            device = jax.devices().index(shard.device)
            np.testing.assert_array_equal(
                np.asarray(shard.data).view(np.int32),
                expected[device * share : (device + 1) * share].view(np.int32),
            )


def test_the_layout_is_static_under_jit():
    preprocessed = {"ids": np.arange(16, dtype=np.int32), "gains": np.ones(8, np.float32)}
    packed = pipelines.pack(preprocessed, DEVICES)
    assert packed.data.shape == (DEVICES, 16)  # 3 columns, padded to 16
    traced = []
    jax.jit(lambda p: traced.append(p.layout) or p.data.sum())(packed)
    assert traced == [packed.layout]


@pytest.mark.parametrize(
    "leaf, message",
    [
        (np.zeros(12, np.int32), r"shape \[12\] .* over 8 devices: dim 0 must split evenly"),
        (np.zeros(16, np.int64), r"dtype int64 .* 4 bytes wide"),
        (np.zeros((), np.int32), r"shape \[\] "),
    ],
)
def test_arrays_that_cannot_be_packed_are_refused(leaf, message):
    with pytest.raises(ValueError, match=message):
        pipelines.pack({"row_pointers": leaf}, DEVICES)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(preprocessed_inputs())
def test_packing_into_a_given_array_of_the_static_shape(preprocessed):
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), preprocessed)
    shape = pipelines.packed_shape(shapes, DEVICES)
    out = np.full(shape, -1, np.int32)  # every column must be written, padding included
    packed = pipelines.pack(preprocessed, DEVICES, out=out)
    assert packed.data is out
    np.testing.assert_array_equal(out, pipelines.pack(preprocessed, DEVICES).data)
    _assert_same_bits(packed.unpack(), preprocessed)


def test_packing_into_an_array_of_another_shape_is_refused():
    leaf = np.zeros(DEVICES * 3, np.int32)
    preprocessed = embedding.PreprocessedInput(
        embedding.SparseDenseMatmulInput({"a": leaf}, {"a": leaf}, {"a": leaf}, {"a": leaf}),
        num_minibatches=np.ones(DEVICES, np.int32),
    )
    rows, width = pipelines.packed_shape(preprocessed, DEVICES)
    with pytest.raises(ValueError, match=rf"packs into int32\[{rows}, {width}\]"):
        pipelines.pack(preprocessed, DEVICES, out=np.zeros((rows, width + 16), np.int32))
