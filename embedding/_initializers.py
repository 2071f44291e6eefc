"""Table initializers as picklable, comparable values.

They follow the `jax.nn.initializers` calling convention, `init(key, shape,
dtype) -> array`, so any `jax.nn.initializers` function works in a `TableSpec`
as well. These classes exist because specs travel to input-pipeline worker
processes (pickled) and are compared when a config is reloaded; closures from
`jax.nn.initializers` are neither picklable nor equal across loads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Normal:
    """Normal(mean, stddev) entries."""

    stddev: float = 0.01
    mean: float = 0.0

    def __call__(self, key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
        return self.mean + self.stddev * jax.random.normal(key, shape, dtype)


@dataclasses.dataclass(frozen=True)
class TruncatedNormal:
    """Normal(0, stddev) truncated to two standard deviations."""

    stddev: float = 0.01

    def __call__(self, key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
        return self.stddev * jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype)


@dataclasses.dataclass(frozen=True)
class Uniform:
    """Uniform entries in [-scale, scale)."""

    scale: float = 0.01

    def __call__(self, key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -self.scale, self.scale)


@dataclasses.dataclass(frozen=True)
class Constant:
    """Every entry equal to `value`."""

    value: float = 0.0

    def __call__(self, key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
        del key
        return jnp.full(shape, self.value, dtype)
