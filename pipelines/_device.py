"""Device placement: host batches -> global `jax.Array`s, prefetched while a step runs.

Every array of a `HostBatch` is this host's share of a global array whose
dim 0 follows the devices of the 1-D mesh: the layout arrays per stacked
table (`[L * ...]` per host -> `[G * ...]`), `num_minibatches` (`[L]` ->
`[G]`), the dense features and the labels (`[host_batch, ...]` ->
`[global_batch, ...]`). The layout arrays come packed into one
`int32[L, width]` array (`PackedInput`, packed where the batch was
prepared), so a batch is three transfers, not one per array.
`jax.make_array_from_process_local_data` assembles them, device d holding
its own slice.

`DeviceIterator` does this in a background thread that keeps up to
`buffer_size` batches on the devices ahead of the training loop, and keeps,
with each batch, the host iterator's state after it: `get_state()` is the
position after the last batch the loop took, not after the batches still in
the buffer, so a checkpoint resumes exactly.

A `next()` that waits for a batch checks the host's worker processes as it
waits and gives up after the input timeout, so that a dead or stuck input is
an error that names it, never a hang: the thread may be stuck inside the
input, where nothing can interrupt it, but the caller never is.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import embedding
from embedding.checks import check_int
from pipelines._errors import InputTimeoutError, InputWorkerError
from pipelines._host_iterator import HostIterator
from pipelines._packing import PackedInput
from pipelines._preprocess_stage import HostBatch

_PUT_POLL_S = 0.1
# How often a waiting `next()` checks the workers.
_CHECK_S = 0.5
# The longest a `DeviceIterator` waits for a batch by default: a first batch
# includes starting the worker processes, and workers at idle priority on a
# busy host are slow, but not this slow.
DEFAULT_INPUT_TIMEOUT_S = 600.0


class DeviceBatch(NamedTuple):
    """A global batch on the devices.

    Attributes:
      batch_number: the global batch's index.
      sparse: the layout, packed (`PackedInput`, a global `int32[G, width]`
        sharded by rows); pass it to a jitted step and `unpack()` it there
        into the input of `embedding.sparse_dense_matmul`.
      dense: `float32[global_batch, num_dense_features]`, sharded by rows.
      labels: `int32[global_batch]`, sharded by rows.
    """

    batch_number: int
    sparse: PackedInput
    dense: jax.Array
    labels: jax.Array

    @property
    def preprocessed(self) -> embedding.PreprocessedInput:
        """The layout as global arrays sharded over the mesh on dim 0
        (`row_pointers` `int32[G * ...]`, ..., `num_minibatches` `int32[G]`),
        unpacked outside a step (one small program per array)."""
        return self.sparse.unpack()


def _row_sharding(mesh: Mesh) -> NamedSharding:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if len(mesh.axis_names) != 1:
        raise ValueError(
            f"Batches shard over a 1-D mesh; got axes {mesh.axis_names}. Build one with "
            "jax.sharding.Mesh(jax.devices(), ('x',))."
        )
    return NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))


def to_device_batch(batch: HostBatch, mesh: Mesh) -> DeviceBatch:
    """Assembles the global arrays of `batch` over `mesh` (every host calls it).

    Raises:
      ValueError: the mesh is not 1-D, or its local devices are not those
        the batch was preprocessed for.
    """
    sharding = _row_sharding(mesh)
    local = batch.sparse.data.shape[0]
    if local != mesh.local_mesh.size:
        raise ValueError(
            f"Batch {batch.batch_number} was preprocessed for {local} local devices, the "
            f"mesh has {mesh.local_mesh.size} on this host; set local_device_count to "
            "mesh.local_mesh.size."
        )
    # One call for the whole pytree: the transfers go out as one batch, not
    # one Python round trip per array.
    data, dense, labels = jax.make_array_from_process_local_data(
        sharding, (batch.sparse.data, batch.dense, batch.labels)
    )
    return DeviceBatch(
        batch_number=batch.batch_number,
        sparse=PackedInput(data, batch.sparse.layout),
        dense=dense,
        labels=labels,
    )


class _End(NamedTuple):
    error: BaseException | None


class DeviceIterator(Iterator[DeviceBatch]):
    """Global device batches of a `HostIterator`, placed ahead in a background thread.

    Args:
      host: the host batches (closed with this iterator).
      mesh: the 1-D mesh of all devices.
      buffer_size: batches kept on the devices ahead of the caller.
      timeout_s: the longest `next()` (and `set_state()`) waits for the
        input before it raises `InputTimeoutError`.

    Example:
      with DeviceIterator(make_grain_iterator(...), mesh) as batches:
          for batch in batches:
              state = train_step(state, batch)
    """

    def __init__(
        self,
        host: HostIterator,
        mesh: Mesh,
        *,
        buffer_size: int = 2,
        timeout_s: float = DEFAULT_INPUT_TIMEOUT_S,
    ):
        check_int(buffer_size, "buffer_size", 1)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}.")
        _row_sharding(mesh)
        self._timeout_s = timeout_s
        self._host = host
        self._mesh = mesh
        self._buffer: queue.Queue = queue.Queue(maxsize=buffer_size)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state = host.get_state()
        self._ended: _End | None = None
        self._closed = False

    @property
    def num_batches(self) -> int:
        return self._host.num_batches

    @property
    def host(self) -> HostIterator:
        """The host iterator the batches come from (closed with this iterator)."""
        return self._host

    def stats(self) -> dict:
        """The pipeline's per-stage statistics (see `PipelineStats.as_dict`)."""
        return self._host.stats()

    def __iter__(self) -> DeviceIterator:
        return self

    def __next__(self) -> DeviceBatch:
        """The next batch.

        Raises:
          InputWorkerError: a worker process of the input ended.
          InputTimeoutError: no batch came within `timeout_s`.
        """
        if self._ended is None:
            self.start_prefetch()
            start = time.perf_counter()
            try:
                item = self._wait()
            except (InputWorkerError, InputTimeoutError) as error:
                self._ended = _End(error)
                raise
            self._host.pipeline_stats.add_device_wait(time.perf_counter() - start)
            if not isinstance(item, _End):
                batch, self._state = item
                return batch
            self._ended = item
            self._join()
        if self._ended.error is not None:
            raise self._ended.error
        raise StopIteration

    def start_prefetch(self) -> None:
        """Starts placing batches before the first `next()`."""
        if self._closed:
            raise ValueError("The device iterator is closed.")
        if self._thread is None and self._ended is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._produce, name="sparseflow-device-prefetch", daemon=True
            )
            self._thread.start()

    def get_state(self) -> bytes:
        """The host iterator's state after the last batch this iterator returned."""
        return self._state

    def set_state(self, state: bytes) -> None:
        """Continues after the batch a `get_state()` state was taken at."""
        self._join()
        self._host.set_state(state)
        self._state = state
        self._ended = None

    def close(self) -> None:
        """Stops the thread (once the batch it prepares is ready) and closes the host iterator.

        After the input failed (`InputWorkerError`, `InputTimeoutError`) the
        thread, which may wait inside the failed input, is not waited for.
        """
        if self._closed:
            return
        self._closed = True
        failed = self._ended is not None and isinstance(
            self._ended.error, (InputWorkerError, InputTimeoutError)
        )
        try:
            self._join(wait=not failed)
        finally:
            self._host.close()

    def __enter__(self) -> DeviceIterator:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    host_batch = next(self._host)
                except StopIteration:
                    self._put(_End(None))
                    return
                state = self._host.get_state()
                start = time.perf_counter()
                batch = to_device_batch(host_batch, self._mesh)
                self._host.pipeline_stats.add_device_put(time.perf_counter() - start)
                self._put((batch, state))
        except Exception as error:  # handed to the caller's next()
            self._put(_End(error))

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._buffer.put(item, timeout=_PUT_POLL_S)
                return
            except queue.Full:
                continue

    def _wait(self):
        """The next item of the buffer; checks the host's workers while it waits."""
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                return self._buffer.get(timeout=min(_CHECK_S, max(deadline - time.monotonic(), 0)))
            except queue.Empty:
                pass
            self._host.check_workers()
            if time.monotonic() >= deadline:
                raise InputTimeoutError(
                    f"No input batch came within {self._timeout_s:g} s: "
                    f"{self._host.awaited()}. A slower input needs a longer timeout."
                )

    def _join(self, *, wait: bool = True) -> None:
        """Stops the thread (after the batch it is preparing) and empties the buffer.

        Args:
          wait: wait for the thread to stop; without, a thread waiting inside
            a failed input is left behind (it puts nothing more).

        Raises:
          InputTimeoutError: the thread waited for the input longer than `timeout_s`.
        """
        if self._thread is None:
            return
        self._stop.set()
        # A thread that waits to put a batch into the full buffer puts it now
        # and sees the stop, instead of at its next poll (`_PUT_POLL_S`).
        self._empty_buffer()
        if wait:
            self._thread.join(self._timeout_s)
            if self._thread.is_alive():
                error = InputTimeoutError(
                    f"The input did not deliver within {self._timeout_s:g} s: "
                    f"{self._host.awaited()}."
                )
                self._ended = _End(error)
                raise error
        self._thread = None
        self._empty_buffer()

    def _empty_buffer(self) -> None:
        while not self._buffer.empty():
            self._buffer.get_nowait()
