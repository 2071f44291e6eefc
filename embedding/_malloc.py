"""Keeps the memory a step frees for the next step (glibc's malloc).

XLA:CPU allocates each execution's temporaries with `posix_memalign` and
frees them when it ends. glibc serves a block above its mmap threshold with a
fresh mapping, unmapped on free, and gives the heap's free top back to the
kernel beyond its trim threshold; both thresholds adapt to the allocation
history, so in some processes every step mapped, faulted in and zeroed its
temporaries again, and the sparse step of `benchmarks/scale.py` took twice
as long at some table sizes as at their neighbours (docs/benchmarks.md).
Fixed thresholds keep such blocks in the heap, and with them up to
`TRIM_THRESHOLD` that one-time work freed (initializing the tables,
compiling a step): `give_back_freed_memory` returns that once it is done.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

_LOG = logging.getLogger(__name__)

# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2): blocks up to
# it come from the heap.
MMAP_THRESHOLD = 32 * 2**20
# Free memory the heap's top keeps (beyond it, the top goes back to the kernel).
TRIM_THRESHOLD = 4 * MMAP_THRESHOLD


def _set_by_environment(variable: str, tunable: str) -> bool:
    """Whether the user set a threshold for this process (`MALLOC_*_` or
    `GLIBC_TUNABLES`): theirs is kept."""
    return variable in os.environ or f"glibc.malloc.{tunable}=" in os.environ.get(
        "GLIBC_TUNABLES", ""
    )


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library, where it is glibc (other libcs' mallopt differ), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


def give_back_freed_memory() -> bool:
    """Returns the heap's free memory to the kernel (glibc's `malloc_trim`).

    For after one-time work whose freed memory the steps do not use again:
    initializing the tables and compiling and running the first step leave
    tens of MB free in the heap, which the fixed trim threshold keeps
    (docs/benchmarks.md). The steps' own temporaries come back at the next
    step and stay.

    Returns:
      Whether memory was given back (False where the C library is not glibc).
    """
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


@functools.cache
def keep_freed_memory() -> bool:
    """Sets glibc's mmap and trim thresholds, once per process, but for one the
    environment sets.

    Returns:
      Whether both are now fixed (by this or by the environment): False where
      the C library is not glibc.
    """
    libc = _glibc()
    if libc is None:
        return False
    done = True
    for parameter, value, variable, tunable in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", "mmap_threshold"),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", "trim_threshold"),
    ):
        if not _set_by_environment(variable, tunable):
            done = bool(libc.mallopt(parameter, value)) and done
    if not done:
        _LOG.warning("glibc's mallopt refused the thresholds; steps may map their memory anew.")
    return done
