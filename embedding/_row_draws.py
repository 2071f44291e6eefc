"""Blocks of rows of a random draw, each entry as the whole draw gives it.

Under partitionable threefry (JAX's default), `jax.random.bits(key, shape)`
gives the entry of flat index `i` from `threefry2x32(key, i)` alone (the two
output words xor-ed), whatever the shape; JAX's float distributions
(`uniform`, `normal`, `truncated_normal`) draw their bits once and map each
entry's bits to its value on their own. So rows `[a, a + c)` of
`initializer(key, shape)` are `initializer` over those rows' counters only.
`draw_rows` draws them so: through a PRNG implementation whose key also
holds the first counter, JAX's own distributions map the bits, and a
table is initialized a block of rows at a time. XLA:CPU holds several
temporaries the size of what one draw makes, which for a whole table were
larger than the table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import define_prng_impl, threefry2x32_p


def _random_bits(key_data: jax.Array, bit_width: int, shape: Sequence[int]) -> jax.Array:
    """`uint32[*shape]`: the threefry bits of counters `first + flat index`.

    `key_data` is `uint32[4]`: the threefry key's two words, then the first
    counter's high and low words.
    """
    if bit_width != 32:
        raise NotImplementedError(f"draw_rows draws 32-bit values, not {bit_width}-bit ones.")
    shape = tuple(shape)
    if math.prod(shape) >= 2**32:
        raise NotImplementedError("draw_rows draws blocks of fewer than 2**32 entries.")
    strides = np.cumprod((*shape[1:], 1)[::-1])[::-1]
    # An iota per dimension, as JAX draws its own counters, so that XLA's
    # partitioner gives each device the counters of its own entries.
    index = sum(
        jax.lax.broadcasted_iota(jnp.uint32, shape, d) * np.uint32(stride)
        for d, stride in enumerate(strides)
    )
    low = key_data[3] + index
    high = key_data[2] + (low < index).astype(jnp.uint32)  # the carry of the low word
    bits1, bits2 = threefry2x32_p.bind(key_data[0], key_data[1], high, low)
    return bits1 ^ bits2


def _unsupported(*_):
    raise NotImplementedError(
        "draw_rows' keys only draw bits: they are not seeded, split or folded."
    )


_THREEFRY_FROM_COUNTER = define_prng_impl(
    key_shape=(4,),
    seed=_unsupported,
    split=_unsupported,
    random_bits=_random_bits,
    fold_in=_unsupported,
    name="threefry2x32_from_counter",
    tag="fry_from",
)


def draws_by_counter(key: jax.Array) -> bool:
    """Whether `key`'s draws give each entry from its flat index alone (a threefry
    key under partitionable threefry), so `draw_rows` can take blocks of them."""
    # `key_impl` gives the impls JAX registers by their names.
    threefry = jax.random.key_impl(key) == "threefry2x32"
    return bool(jax.config.jax_threefry_partitionable) and threefry


def draw_rows(
    initializer: Callable,
    key: jax.Array,
    shape: Sequence[int],
    first_rows: np.ndarray,
    block: jax.Array,
    rows: int,
) -> jax.Array:
    """Rows `[s, s + rows)` of `initializer(key, shape, float32)`, `s = first_rows[block]`.

    Args:
      initializer: one of `embedding.initializers`' random ones (JAX's
        `uniform`, `normal` or `truncated_normal` over float32).
      key: a threefry key (`draws_by_counter(key)`).
      shape: the whole draw's shape.
      first_rows: `int[blocks]`, the first row of each block (static).
      block: `int32[]`, which block (may be traced).
      rows: the rows of a block.

    Returns:
      `float32[rows, *shape[1:]]`, bitwise the whole draw's rows.
    """
    row_size = math.prod(shape[1:])
    counters = np.asarray(first_rows, np.uint64) * np.uint64(row_size)
    words = np.stack([counters >> np.uint64(32), counters & np.uint64(0xFFFFFFFF)], axis=1)
    first_counter = jnp.asarray(words.astype(np.uint32))[block]
    data = jnp.concatenate([jax.random.key_data(key).astype(jnp.uint32), first_counter])
    from_counter = jax.random.wrap_key_data(data, impl=_THREEFRY_FROM_COUNTER)
    return initializer(from_counter, (rows, *shape[1:]), jnp.float32)
