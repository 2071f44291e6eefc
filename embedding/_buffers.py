"""Aligned host buffers, and the layout's padded buffers kept from call to call.

A stack's layout buffers hold `L * coo_size` entries, and every entry no id
fills is padding `(INT32_MAX, INT32_MAX, NaN)` (docs/design.md section 2).
With loose limits most of a buffer is padding: at limits 8192 writing it into
fresh memory costs more than laying out the ids. So buffers are kept: one
that no array refers to any more is handed out again, and only what the
previous layout wrote into it (each slot's start up to its aligned end) is
padded again. The padding then costs in proportion to the ids, not to the
buffer's capacity.
"""

from __future__ import annotations

import sys
import threading
from typing import NamedTuple

import numpy as np

INT32_MAX = np.iinfo(np.int32).max
_BUFFER_ALIGNMENT = 64
# Pooled buffers per size: one per stack of two calls in flight for the
# shipped configs. A buffer found in use when the pool is full is allocated
# fresh and not kept, so the pool retains at most this many per size.
_MAX_POOLED_PER_SIZE = 16
# `sys.getrefcount` of an owner array nothing else refers to: the owner tuple
# and the call's own argument.
_UNREFERENCED = 2


def aligned_empty(size: int, dtype) -> np.ndarray:
    """`dtype[size]` (uninitialized) starting on a 64-byte boundary.

    On CPU devices, placing a host array whose device slices start on such
    boundaries aliases its memory instead of copying it.
    """
    nbytes = size * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + _BUFFER_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % _BUFFER_ALIGNMENT
    return raw[start : start + nbytes].view(dtype)


class LayoutArrays(NamedTuple):
    """One stack's padded layout buffers.

    Attributes:
      embedding_ids: `int32[size]`, INT32_MAX where nothing was written.
      sample_ids: `int32[size]`, INT32_MAX where nothing was written.
      gains: `float32[size]`, NaN where nothing was written.
    """

    embedding_ids: np.ndarray
    sample_ids: np.ndarray
    gains: np.ndarray


_PADDING = LayoutArrays(INT32_MAX, INT32_MAX, np.nan)
_DTYPES = LayoutArrays(np.int32, np.int32, np.float32)


class PaddedBuffers:
    """Layout buffers and the ranges a layout wrote into them.

    Every view of the buffers refers to the three owner arrays (numpy makes a
    view of a view refer to the array owning the memory), so the buffers are
    free again exactly when the owners' reference counts drop back.
    """

    def __init__(self, size: int):
        views = [aligned_empty(size, dtype) for dtype in _DTYPES]
        self._owners = tuple(view.base for view in views)
        self._starts = tuple(view.ctypes.data - view.base.ctypes.data for view in views)
        self._nbytes = tuple(view.nbytes for view in views)
        # `[start, stop)` ranges written since the last padding; None: all.
        self._written: tuple[np.ndarray, np.ndarray] | None = None

    def take(self) -> tuple[LayoutArrays, tuple[np.ndarray, np.ndarray] | None]:
        """Writable views (marking the buffers in use) and the ranges to pad."""
        views = LayoutArrays(*(self._fresh_view(i) for i in range(len(self._owners))))
        written, self._written = self._written, None
        return views, written

    def in_use(self) -> bool:
        owners = self._owners
        return any(sys.getrefcount(owners[i]) > _UNREFERENCED for i in range(len(owners)))

    def mark_written(self, starts: np.ndarray, stops: np.ndarray) -> None:
        """Records that a layout wrote only `[starts[k], stops[k])`."""
        self._written = (starts, stops)

    def _fresh_view(self, i: int) -> np.ndarray:
        start = self._starts[i]
        return self._owners[i][start : start + self._nbytes[i]].view(_DTYPES[i])


def _pad(arrays: LayoutArrays, written: tuple[np.ndarray, np.ndarray] | None) -> None:
    """Writes the padding over `written` ranges, or over everything if None."""
    for array, value in zip(arrays, _PADDING):
        if written is None:
            array.fill(value)
            continue
        for start, stop in zip(*written):
            array[start:stop] = value


class BufferPool:
    """Padded layout buffers by size, shared by the threads laying out stacks."""

    def __init__(self, max_per_size: int = _MAX_POOLED_PER_SIZE):
        self._max_per_size = max_per_size
        self._lock = threading.Lock()
        self._by_size: dict[int, list[PaddedBuffers]] = {}

    def acquire(self, size: int) -> tuple[PaddedBuffers, LayoutArrays]:
        """A free buffer of `size` entries (all padding) and its writable views.

        The caller records what it writes with `PaddedBuffers.mark_written`;
        without that the whole buffer is padded again on its next use.
        """
        with self._lock:
            pooled = self._by_size.setdefault(size, [])
            buffers = next((b for b in pooled if not b.in_use()), None)
            if buffers is None:
                buffers = PaddedBuffers(size)
                if len(pooled) < self._max_per_size:
                    pooled.append(buffers)
            # Taking the views inside the lock marks the buffers in use before
            # another thread can look at them.
            arrays, written = buffers.take()
        _pad(arrays, written)
        return buffers, arrays
