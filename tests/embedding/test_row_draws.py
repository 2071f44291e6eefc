"""Blocks of rows of a random draw (`embedding._row_draws`) against the whole draw
and against Threefry-2x32 computed in numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import embedding
from embedding._row_draws import draw_rows, draws_by_counter

INITIALIZERS = [
    embedding.initializers.Normal(stddev=0.1, mean=0.5),
    embedding.initializers.TruncatedNormal(stddev=0.3),
    embedding.initializers.Uniform(scale=0.2),
]


def threefry2x32(key: np.ndarray, high: np.ndarray, low: np.ndarray) -> tuple:
    """Random123's Threefry-2x32 with 20 rounds over counters `(high, low)`, in numpy."""
    rotations = [(13, 15, 26, 6), (17, 29, 16, 24)]
    k0, k1 = (np.uint32(k) for k in key)
    keys = [k0, k1, k0 ^ k1 ^ np.uint32(0x1BD11BDA)]
    x0, x1 = high + keys[0], low + keys[1]
    for i in range(5):
        for r in rotations[i % 2]:
            x0 = x0 + x1
            x1 = (x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r))
            x1 = x1 ^ x0
        x0 = x0 + keys[(i + 1) % 3]
        x1 = x1 + keys[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def reference_bits(key: jax.Array, first: int, count: int) -> np.ndarray:
    """`uint32[count]`: JAX's partitionable bits of flat indices `first ...`."""
    index = np.uint64(first) + np.arange(count, dtype=np.uint64)
    high = (index >> np.uint64(32)).astype(np.uint32)
    with np.errstate(over="ignore"):
        x0, x1 = threefry2x32(np.asarray(jax.random.key_data(key)), high, index.astype(np.uint32))
    return x0 ^ x1


def _bits(key, shape, dtype):
    del dtype
    return jax.random.bits(key, shape, jnp.uint32)


@pytest.mark.parametrize("initializer", INITIALIZERS)
@pytest.mark.parametrize("key", [jax.random.key(5), jax.random.PRNGKey(9)], ids=["key", "raw"])
def test_blocks_are_the_whole_draws_rows_bitwise(initializer, key):
    """Against the whole draw in one jitted program, as the tables' init draws:
    XLA fuses a distribution's arithmetic there (eagerly, op by op, a mean
    plus a scaled draw rounds differently in the last bit)."""
    shape = (1000, 4, 16)
    whole = np.asarray(jax.jit(lambda k: initializer(k, shape, jnp.float32))(key))
    first_rows = np.array([0, 37, 990])

    @jax.jit
    def block(k, b):
        return draw_rows(initializer, k, shape, first_rows, b, 10)

    for b, first in enumerate(first_rows):
        np.testing.assert_array_equal(np.asarray(block(key, b)), whole[first : first + 10])


def test_the_numpy_reference_is_jaxs_own_bits():
    key = jax.random.key(11)
    bits = np.asarray(jax.random.bits(key, (64, 3, 5), jnp.uint32)).reshape(-1)
    np.testing.assert_array_equal(bits, reference_bits(key, 0, bits.size))


def test_counters_past_two_to_the_32_carry_into_the_high_word():
    """A table of 4e8 rows of 16 holds 6.4e9 entries: blocks on either side of
    entry 2**32, and one straddling it, draw the counters JAX would."""
    key = jax.random.key(11)
    shape = (400_000_000, 16)
    first_rows = np.array([268_435_440, 268_435_455, 399_999_990])
    for b, first in enumerate(first_rows):
        got = np.asarray(draw_rows(_bits, key, shape, first_rows, b, 10)).reshape(-1)
        np.testing.assert_array_equal(got, reference_bits(key, int(first) * 16, 160))


def test_only_threefry_keys_draw_by_counter():
    assert draws_by_counter(jax.random.key(0))
    assert draws_by_counter(jax.random.PRNGKey(0))
    assert not draws_by_counter(jax.random.key(0, impl="rbg"))
