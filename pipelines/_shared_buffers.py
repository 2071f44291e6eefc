"""Packed batches handed from Grain worker processes to the training process in shared memory.

A pickled batch crosses a pipe: the worker copies it out, the training
process copies it in and then places an array whose rows are not 64-byte
aligned, which the CPU backend copies once more. On 2 cores that costs the
training step about as much time as the copies take.

`SharedBatchBuffers` is one shared-memory file that holds, for each worker,
`slots` buffers of one packed batch each (`int32[devices, width]`, rows on
64-byte boundaries), mapped once by every process. A worker packs a batch
straight into a free slot (`acquire`); the slot's array pickles as a reference
(file, slot, generation), and unpickles in the training process as a numpy
view of the same memory, which the CPU backend places without a copy.

A slot is in use from `acquire` until every array that views it in the
training process is gone, the device arrays that alias it included. Two
counters per slot say so: `published` (written only by the worker that owns
the slot, once per `acquire`) and `released` (written only by the training
process, when the last view of a generation is collected); a slot is free
when they are equal. When no slot of a worker is free (the consumer holds
more batches than there are slots), `acquire` returns None and the batch
travels pickled: slower, never blocked, never overwritten while in use.

On Linux the file is anonymous (`memfd_create`): the workers open it through
the training process's `/proc/<pid>/fd`, and the kernel frees it when the last
process that maps it ends, however it ends, so a killed run leaves nothing in
`/dev/shm`. Elsewhere it is a temporary file, removed by `close()`.

Only one iterator may run over a dataset's buffers at a time: two sets of
workers with the same indices would share counters.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import weakref

import numpy as np

_PAGE = mmap.PAGESIZE
_COUNTERS = 2  # published, released
# Regions mapped by this process, by path; arrays viewing a region keep it mapped.
_regions: dict[str, np.ndarray] = {}
_regions_lock = threading.Lock()
# Finalizers of different threads may release the same slot's generations.
_release_lock = threading.Lock()


class SharedBatchBuffers:
    """Per-worker slots of packed batches in one shared-memory file.

    Create it in the training process, hand it to the workers by pickling
    (the copy maps the file on first use), and `close()` it after the workers
    stopped.

    Args:
      workers: W, worker processes (slot owners).
      slots: buffers per worker; more than the batches the consumer keeps
        alive at once (prefetch buffers, steps in flight) plus those the
        worker prepares ahead.
      shape: `(devices, width)` of a packed batch (`pipelines.packed_shape`).

    Raises:
      OSError: the file cannot be created at its full size (not enough
        shared memory).
    """

    def __init__(
        self,
        *,
        workers: int,
        slots: int,
        shape: tuple[int, int],
    ):
        if workers < 1 or slots < 1:
            raise ValueError(f"workers and slots must be >= 1, got {workers} and {slots}.")
        self._count = workers * slots
        self._slots = slots
        self._shape = (int(shape[0]), int(shape[1]))
        self._slot_bytes = _round_up(self._shape[0] * self._shape[1] * 4, _PAGE)
        self._header_bytes = _round_up(_COUNTERS * self._count * 8, _PAGE)
        self._size = self._header_bytes + self._count * self._slot_bytes
        self._fd, self._path, self._identity = _create(self._size)
        self._cursor = 0
        self._owner = True
        self._region = _map(self._path, self._size, self._identity)

    @property
    def path(self) -> str:
        """Where other processes open the file (while the creating process has not closed it)."""
        return self._path

    def acquire(self, worker: int) -> np.ndarray | None:
        """In worker `worker`: a free slot as `int32[devices, width]`, or None when none is free.

        The array's contents are undefined; write the batch into it. Pickled,
        it sends a reference to the slot, not its bytes.
        """
        region = self._mapped()
        published, released = _counters(region, self._count)
        first = worker * self._slots
        for step in range(self._slots):
            index = first + (self._cursor + step) % self._slots
            if published[index] == released[index]:
                self._cursor = (self._cursor + step + 1) % self._slots
                published[index] += 1
                return _SlotArray.over(self, region, index, int(published[index]))
        return None

    def close(self) -> None:
        """Lets the file go (in the process that created it); live views stay valid."""
        with _regions_lock:
            _regions.pop(self._path, None)
        self._region = None
        if self._owner:
            self._owner = False
            if self._fd is not None:
                os.close(self._fd)
            else:
                os.unlink(self._path)

    def _mapped(self) -> np.ndarray:
        if self._region is None:
            self._region = _map(self._path, self._size, self._identity)
        return self._region

    def _offset(self, index: int) -> int:
        return self._header_bytes + index * self._slot_bytes

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_region=None, _owner=False, _cursor=0, _fd=None)
        return state

    def __del__(self):
        if getattr(self, "_owner", False):
            self.close()


class _SlotArray(np.ndarray):
    """A worker's view of one slot; pickles as a reference to it."""

    _slot: tuple | None = None

    @classmethod
    def over(cls, buffers: SharedBatchBuffers, region: np.ndarray, index: int, generation: int):
        rows, width = buffers._shape
        start = buffers._offset(index)
        flat = region[start : start + rows * width * 4].view(np.int32)
        array = flat.reshape(rows, width).view(cls)
        array._slot = (
            buffers._path,
            buffers._identity,
            buffers._size,
            buffers._count,
            index,
            generation,
            start,
        )
        return array

    def __reduce__(self):
        if self._slot is None or self.base is None:
            return np.asarray(self).__reduce__()
        return _attach, (*self._slot, self.shape)


def _attach(
    path: str,
    identity: tuple[int, int],
    size: int,
    count: int,
    index: int,
    generation: int,
    start: int,
    shape: tuple,
) -> np.ndarray:
    """Unpickles a slot in the training process: a view that releases the slot when collected."""
    region = _map(path, size, identity)
    _, released = _counters(region, count)
    return np.asarray(_SlotOwner(region, released, index, generation, start, shape))


def _counters(region: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The `published` and `released` counters (`int64[count]` each) at the head of `region`."""
    counters = region[: _COUNTERS * count * 8].view(np.int64)
    return counters[:count], counters[count:]


class _SlotOwner:
    """The base of a slot's views: keeps the region mapped, releases the slot when collected."""

    def __init__(self, region, released, index, generation, start, shape):
        self._region = region
        self.__array_interface__ = {
            "shape": tuple(shape),
            "typestr": "<i4",
            "data": (region.ctypes.data + start, False),
            "version": 3,
        }
        weakref.finalize(self, _release, released, index, generation)


def _release(released: np.ndarray, index: int, generation: int) -> None:
    with _release_lock:
        released[index] = max(int(released[index]), generation)


def _map(path: str, size: int, identity: tuple[int, int]) -> np.ndarray:
    with _regions_lock:
        region = _regions.get(path)
        if region is None:
            gone = RuntimeError(
                f"The shared batch buffers {path} are gone: the input iterator that "
                "created them was closed."
            )
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError as error:
                raise gone from error
            try:
                # A closed descriptor's number may name another file since.
                status = os.fstat(fd)
                if (status.st_dev, status.st_ino) != identity:
                    raise gone
                region = np.frombuffer(mmap.mmap(fd, size), np.uint8)
            finally:
                os.close(fd)
            _regions[path] = region
        return region


def _create(size: int) -> tuple[int | None, str, tuple[int, int]]:
    """`(descriptor to keep open or None, path, (device, inode))` of a new file of `size` bytes."""
    anonymous = hasattr(os, "memfd_create")
    if anonymous:
        fd = os.memfd_create("sparseflow-batches")
        path = f"/proc/{os.getpid()}/fd/{fd}"
    else:
        fd, path = tempfile.mkstemp(prefix="sparseflow-batches-")
    try:
        # Reserves every page now: running out of shared memory later would
        # kill the process with SIGBUS on a write.
        os.posix_fallocate(fd, 0, size)
        status = os.fstat(fd)
    except OSError:
        os.close(fd)
        if not anonymous:
            os.unlink(path)
        raise
    identity = (status.st_dev, status.st_ino)
    if anonymous:
        return fd, path, identity
    os.close(fd)
    return None, path, identity


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
