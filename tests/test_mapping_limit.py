"""The suite's guard against the per-process limit on memory mappings (conftest.py)."""

import jax
import jax.numpy as jnp
from memory_maps import memory_maps, memory_maps_over


def test_clearing_jaxs_caches_frees_the_mappings_of_compiled_programs():
    """What the guard relies on: every executable JAX keeps holds mappings of its
    own, and clearing the caches gives them back."""
    jax.clear_caches()
    before = memory_maps()
    programs = [jax.jit(lambda x, k=k: x * k + k) for k in range(100)]
    for program in programs:
        program(jnp.ones(4)).block_until_ready()
    grown = memory_maps() - before
    assert grown >= 200, grown  # three per executable on XLA:CPU
    jax.clear_caches()
    assert memory_maps() - before < grown / 4


def test_the_share_of_mappings_is_read_from_proc():
    assert memory_maps_over(0.0)
    assert not memory_maps_over(1.0)
