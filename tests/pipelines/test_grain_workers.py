"""Grain worker processes that die or stop while batches are due: errors naming them, no hang.

The workers are found as this process's spawned children in /proc, not
through the code under test, so the pid an error names is checked against
the process that was really killed or stopped.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import threading
import time
from queue import Empty

import jax
import pipeline_cases as cases
import pytest
from process_cases import alive, grain_workers, send_and_wait, wait_for

import embedding
import pipelines
from pipelines import BatchingConfig, GrainOptions, make_grain_iterator
from pipelines._worker_pipes import let_go, pipe_inodes

NUM_RECORDS = 64
BATCH = 8
# Enough batches that the workers are never done within a test.
EPOCHS = 100
# Bounds every wait of a test for the code under test: past it, a hang.
HANG_S = 120.0


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return cases.write_dataset(str(tmp_path_factory.mktemp("workers")), NUM_RECORDS)["arrayrecord"]


def _iterator(
    files, *, local_devices: int = 1, epochs: int = EPOCHS, worker_count: int = 2
) -> pipelines.HostIterator:
    preprocess = cases.preprocess_config(
        BATCH, local_devices=local_devices, global_devices=local_devices, partitions=1
    )
    return make_grain_iterator(
        files,
        batching=BatchingConfig(global_batch_size=BATCH, num_epochs=epochs),
        preprocess=preprocess,
        # Buffers that hold every worker's share: each is done, and Grain ends
        # it, while its batches are still due.
        options=GrainOptions(
            worker_count=worker_count,
            worker_priority="normal",
            worker_buffer_size=NUM_RECORDS // BATCH,
            read_buffer_size=NUM_RECORDS // BATCH,
        ),
    )


def _within(seconds: float, function, what: str):
    """`function()`'s result or exception, in a thread; fails when it takes over `seconds`."""
    outcome = {}

    def run():
        try:
            outcome["value"] = function()
        except BaseException as error:  # handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{what} went on for {seconds:.0f} s: a hang"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _drain(iterator) -> None:
    for _ in iterator:
        pass


def _two_workers() -> list[int]:
    return wait_for(
        lambda: len(grain_workers(os.getpid())) == 2 and grain_workers(os.getpid()),
        HANG_S,
        "the iterator did not start 2 Grain workers",
    )


def _close_and_check_workers_end(iterator, workers: list[int]) -> None:
    try:
        _within(HANG_S, iterator.close, "close()")
    finally:
        left = [pid for pid in workers if alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {left} outlived close()"


def test_a_killed_worker_is_named_with_its_pid_and_signal(files):
    iterator = _iterator(files)
    workers = []
    try:
        for _ in range(4):
            next(iterator)
        workers = _two_workers()
        victim = workers[0]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(pipelines.InputWorkerError) as error:
            _within(HANG_S, lambda: _drain(iterator), "reading past a killed worker")
    finally:
        _close_and_check_workers_end(iterator, workers)
    message = str(error.value)
    assert re.match(
        rf"Grain worker [01] of 2 \(pid {victim}\) was killed by signal 9 \(SIGKILL\), "
        r"while the input needed it \(batch \d+ was due\)",
        message,
    ), message
    assert "out-of-memory killer" in message


def test_a_stopped_worker_times_out_naming_the_batch_it_owes_and_is_ended_by_close(files):
    host = _iterator(files, local_devices=8)
    batches = None
    workers = []
    try:
        # The workers start (seconds on a busy machine) before the short timeout counts.
        for _ in range(4):
            next(host)
        mesh = jax.sharding.Mesh(jax.devices(), ("x",))
        batches = pipelines.DeviceIterator(host, mesh, timeout_s=3)
        next(batches)
        workers = _two_workers()
        victim = workers[0]
        os.kill(victim, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(pipelines.InputTimeoutError) as error:
            _within(HANG_S, lambda: _drain(batches), "reading past a stopped worker")
        waited = time.monotonic() - started
    finally:
        _close_and_check_workers_end(batches or host, workers)
    message = str(error.value)
    # Worker w prepares the batches w, w + 2, ...: the batch awaited is the
    # stopped worker's, and it is named by its pid.
    owed = re.search(
        r"No input batch came within 3 s: batch (\d+) of \d+, prepared by "
        r"Grain worker (\d) of 2 \(pid (\d+), stopped\)",
        message,
    )
    assert owed, message
    assert int(owed[3]) == victim and int(owed[2]) == int(owed[1]) % 2
    # It waited out the timeout (plus the batches the other worker had ready), no more.
    assert 3 <= waited < 30


def _no_workers_left() -> None:
    wait_for(
        lambda: not grain_workers(os.getpid()),
        HANG_S,
        "Grain did not end the workers that made their share",
    )


def test_workers_that_grain_ended_once_their_share_was_made_give_every_batch(files):
    with _iterator(files, epochs=1, worker_count=0) as iterator:
        expected = [cases.flat(batch) for batch in iterator]
    assert len(expected) == NUM_RECORDS // BATCH

    iterator = _iterator(files, epochs=1)
    try:
        taken = [cases.flat(next(iterator))]
        _no_workers_left()
        taken += [cases.flat(batch) for batch in _within(HANG_S, lambda: list(iterator), "reading")]
    finally:
        _close_and_check_workers_end(iterator, [])
    cases.assert_batches_equal(taken, expected)


def test_a_worker_whose_share_was_taken_before_a_restore_may_end_at_once(files):
    # Restored before the last batch, worker 0 has nothing left: Grain ends it
    # at once, before the batch due (worker 1's) arrives.
    last = NUM_RECORDS // BATCH - 1
    with _iterator(files, epochs=1) as iterator:
        for _ in range(last):
            next(iterator)
        state = iterator.get_state()
        expected = cases.flat(next(iterator))
    iterator = _iterator(files, epochs=1)
    try:
        iterator.set_state(state)
        iterator.start_prefetch()
        _no_workers_left()
        taken = _within(HANG_S, lambda: list(iterator), "reading")
    finally:
        _close_and_check_workers_end(iterator, [])
    cases.assert_batches_equal([cases.flat(batch) for batch in taken], [expected])


def test_a_workers_own_error_reaches_the_caller_as_itself(files):
    # Limits of 1 id per partition: the first batch breaches them in the
    # worker that lays it out; Grain passes the error on and stops the worker.
    iterator = make_grain_iterator(
        files,
        batching=BatchingConfig(global_batch_size=BATCH, num_epochs=EPOCHS),
        preprocess=cases.preprocess_config(
            BATCH, local_devices=1, global_devices=1, partitions=1, limit=1
        ),
        options=GrainOptions(worker_count=2, worker_priority="normal"),
    )
    try:
        with pytest.raises(embedding.LimitBreachError) as error:
            _within(HANG_S, lambda: next(iterator), "reading a batch over the limits")
    finally:
        _close_and_check_workers_end(iterator, [])
    assert error.value.batch_number == 0


def test_letting_go_of_a_dead_writers_pipes_ends_the_wait_for_its_half_sent_message():
    context = multiprocessing.get_context("spawn")
    queue, sent = context.Queue(), context.Event()
    writer = context.Process(target=send_and_wait, args=(queue, sent, HANG_S), daemon=True)
    writer.start()
    try:
        assert sent.wait(HANG_S)
        pipes = pipe_inodes(writer.pid)
        time.sleep(0.5)  # its sending thread fills the pipe
    finally:
        writer.kill()
        writer.join(HANG_S)
    outcome = {}
    reader = threading.Thread(
        target=lambda: outcome.update(error=_error_of(queue.get)), daemon=True
    )
    reader.start()
    reader.join(2)
    assert reader.is_alive(), "the half-sent message did not block its reader"
    let_go(pipes)
    reader.join(HANG_S)
    assert not reader.is_alive(), "the reader still waits for the rest of the message"
    assert isinstance(outcome["error"], OSError), outcome
    with pytest.raises(Empty):
        queue.get_nowait()


def _error_of(function) -> BaseException | None:
    try:
        function()
    except BaseException as error:  # the outcome under test
        return error
    return None
