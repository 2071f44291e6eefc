"""Packed batches handed over in shared memory (pipelines/_shared_buffers.py), and the
Grain workers that use them at idle priority (pipelines/_grain.py)."""

import gc
import multiprocessing
import os
import pickle
import tempfile
import time

import jax
import numpy as np
import pipeline_cases as cases
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pipelines
from pipelines import _grain
from pipelines._shared_buffers import SharedBatchBuffers

SHAPE = (8, 32)
TIMEOUT_S = 120


@pytest.fixture
def buffers():
    ring = SharedBatchBuffers(workers=2, slots=2, shape=SHAPE)
    yield ring
    ring.close()


def _handed_over(array: np.ndarray) -> np.ndarray:
    """What the training process gets of a worker's slot: the array pickled and back."""
    message = pickle.dumps(array)
    assert len(message) < 1024  # a reference, not the 1 KiB of data
    return pickle.loads(message)


def _filled(ring: SharedBatchBuffers, worker: int, value: int) -> np.ndarray:
    slot = ring.acquire(worker)
    assert slot is not None and slot.shape == SHAPE and slot.dtype == np.int32
    slot[:] = np.arange(slot.size, dtype=np.int32).reshape(SHAPE) + value
    return slot


def test_a_slot_travels_as_a_reference_to_the_same_memory(buffers):
    slot = _filled(buffers, 0, 7)
    received = _handed_over(slot)
    assert type(received) is np.ndarray
    assert received.ctypes.data == slot.ctypes.data
    assert received.ctypes.data % 64 == 0
    np.testing.assert_array_equal(received, np.arange(256).reshape(SHAPE) + 7)


def test_a_slot_is_reused_only_after_every_view_of_it_is_gone(buffers):
    first = _handed_over(_filled(buffers, 0, 1))
    second = _handed_over(_filled(buffers, 0, 2))
    assert buffers.acquire(0) is None  # both of worker 0's slots are in use
    assert buffers.acquire(1) is not None  # worker 1's slots are its own
    row = first[3]
    address = first.ctypes.data
    del first
    assert buffers.acquire(0) is None  # a row of it is still alive
    del row
    reused = buffers.acquire(0)
    assert reused is not None and reused.ctypes.data == address
    np.testing.assert_array_equal(second, np.arange(256).reshape(SHAPE) + 2)


def test_device_arrays_that_alias_a_slot_keep_it_reserved(buffers):
    mesh = Mesh(jax.devices()[: SHAPE[0]], ("x",))
    received = _handed_over(_filled(buffers, 0, 5))
    placed = jax.make_array_from_process_local_data(
        NamedSharding(mesh, PartitionSpec("x")), received
    )
    # The CPU backend places the 64-byte aligned rows without a copy.
    assert placed.addressable_shards[0].data.unsafe_buffer_pointer() == received.ctypes.data
    assert _filled(buffers, 0, 6) is not None  # worker 0's other slot, never handed over
    del received
    assert buffers.acquire(0) is None
    np.testing.assert_array_equal(np.asarray(placed), np.arange(256).reshape(SHAPE) + 5)
    del placed
    gc.collect()  # jax drops its hold on aliased host memory when its objects are collected
    assert buffers.acquire(0) is not None


def test_closing_lets_the_file_go_and_leaves_live_views_valid():
    ring = SharedBatchBuffers(workers=1, slots=2, shape=SHAPE)
    received = _handed_over(_filled(ring, 0, 3))
    late = pickle.dumps(_filled(ring, 0, 4))
    ring.close()
    np.testing.assert_array_equal(received, np.arange(256).reshape(SHAPE) + 3)
    with pytest.raises(RuntimeError, match="are gone"):
        pickle.loads(late)


def _worker(ring: SharedBatchBuffers, out, commands) -> None:
    """A worker process: sends batches in slots while it gets any, then says it ran out."""
    for value in iter(commands.get, None):
        slot = ring.acquire(0)
        if slot is None:
            out.put(None)
            continue
        slot[:] = value
        out.put(slot)


def test_a_worker_process_hands_over_batches_and_reuses_released_slots(buffers):
    context = multiprocessing.get_context("spawn")
    out, commands = context.Queue(), context.Queue()
    process = context.Process(target=_worker, args=(buffers, out, commands))
    process.start()
    try:
        held = []
        for value in (11, 12, 13):
            commands.put(value)
            held.append(out.get(timeout=TIMEOUT_S))
        assert held[2] is None  # two slots, both held here
        np.testing.assert_array_equal(held[0], 11)
        np.testing.assert_array_equal(held[1], 12)
        del held[0]
        commands.put(14)
        again = out.get(timeout=TIMEOUT_S)
        np.testing.assert_array_equal(again, 14)
        np.testing.assert_array_equal(held[0], 12)  # the slot still held is untouched
    finally:
        commands.put(None)
        process.join(TIMEOUT_S)
        if process.is_alive():
            process.kill()
    assert process.exitcode == 0


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return cases.write_dataset(str(tmp_path_factory.mktemp("shared")), 64)["arrayrecord"]


def _in_shared_buffers(address: int) -> bool:
    """Whether `address` lies in this process's mapping of a `SharedBatchBuffers` file."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and "sparseflow-batches" in fields[5]:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= address < end:
                    return True
    return False


def _holds_buffers(ring_creator) -> None:
    """A process that creates shared buffers, writes a slot and waits to be killed."""
    ring = SharedBatchBuffers(workers=1, slots=2, shape=SHAPE)
    ring.acquire(0)[:] = 1
    ring_creator.put(ring.path)
    time.sleep(TIMEOUT_S)


def test_a_killed_process_leaves_no_file_behind():
    context = multiprocessing.get_context("spawn")
    paths = context.Queue()
    process = context.Process(target=_holds_buffers, args=(paths,))
    process.start()
    path = paths.get(timeout=TIMEOUT_S)
    process.kill()
    process.join(TIMEOUT_S)
    assert not os.path.exists(path)
    leftovers = [
        name
        for directory in ("/dev/shm", tempfile.gettempdir())
        if os.path.isdir(directory)
        for name in os.listdir(directory)
        if name.startswith("sparseflow-batches")
    ]
    assert leftovers == []


def _iterator(data, **options) -> pipelines.HostIterator:
    return pipelines.make_grain_iterator(
        data,
        batching=pipelines.BatchingConfig(global_batch_size=16, shuffle_seed=3),
        preprocess=cases.preprocess_config(16, local_devices=8, global_devices=8, partitions=1),
        options=pipelines.GrainOptions(**options),
    )


@pytest.mark.parametrize("priority", list(pipelines.WorkerPriority))
def test_grain_workers_run_at_their_priority_and_hand_batches_over_in_place(data, priority):
    with _iterator(data) as iterator:
        expected = [cases.flat(batch) for batch in iterator]
    with _iterator(data, worker_count=1, worker_priority=priority) as iterator:
        batches = [next(iterator)]
        # Grain stops its worker at the end of the data: look at it before.
        (worker,) = multiprocessing.active_children()
        policies = {
            os.sched_getscheduler(int(task)) for task in os.listdir(f"/proc/{worker.pid}/task")
        }
        batches += list(iterator)
        in_place = [_in_shared_buffers(b.sparse.data.ctypes.data) for b in batches]
    cases.assert_batches_equal([cases.flat(b) for b in batches], expected)
    want = os.SCHED_IDLE if priority is pipelines.WorkerPriority.IDLE else os.SCHED_OTHER
    assert policies == {want}
    assert len(batches) == 4
    # The 16 slots outnumber the batches: every one comes in shared memory.
    assert all(in_place)


def _initialized_worker(out) -> None:
    _grain.init_grain_worker(0, 1, priority=pipelines.WorkerPriority.NORMAL)
    out.put(gc.get_freeze_count())


def test_a_grain_worker_keeps_its_imports_out_of_full_collections():
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=_initialized_worker, args=(out,))
    process.start()
    try:
        frozen = out.get(timeout=TIMEOUT_S)
    finally:
        process.join(TIMEOUT_S)
    assert process.exitcode == 0
    # numpy, jax and the pipeline's modules: far more than a few objects.
    assert frozen > 10_000
