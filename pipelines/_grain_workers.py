"""The Grain worker processes of one iterator: which is which, and how one ended.

Grain's `mp_prefetch` starts the worker processes and does not say which
process is worker w. Each worker therefore reports its index and pid as it
starts (`GrainWorkers.register`, from `init_grain_worker`) through a pipe of
the training process, which it opens by path (`/proc/<pid>/fd/<n>`: spawned
processes inherit no descriptors). The training process reads the reports
when it checks the workers and keeps each worker's `multiprocessing.Process`
(Grain's own, among `multiprocessing.active_children()`): its exit code says
how the worker ended, whichever thread collected it.

Grain notices a dead worker only when the worker's queue is empty and whole;
a worker killed while it sends a batch larger than a pipe's buffer leaves half
a batch there, and Grain's reader waits for the rest forever. The checks
here do not read the queues, so they find that worker too, and then let go
of the pipes it shared with the training process (`_worker_pipes`), which
ends that wait.

Grain also ends workers on purpose, and a worker exits with status 0 only
then (its loop ends when Grain asks it to stop): once the worker's share of a
finite input is made, as soon as Grain's reader, which reads ahead, finds the
share's end, possibly while batches it made are still due; and after passing
on an error the worker raised (a bad batch, a limit breach), which must reach
the caller as itself. So status 0 is no failure. A worker whose status is
unknown (collected by another, Grain say) is done, not dead, when it has
reported making its last batch (`made_last_batch`) or when every batch of
its share was already taken.

Without `/proc` the workers do not report: errors name the worker by its
index only, and a worker's death is Grain's to notice.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import struct
import threading
import time

from pipelines._errors import InputWorkerError
from pipelines._worker_pipes import let_go, pipe_inodes

_log = logging.getLogger(__name__)
# A report: worker index, pid, event. Smaller than PIPE_BUF, so written whole.
_REPORT = struct.Struct("<qqq")
_STARTED = 0
_MADE_LAST_BATCH = 1
# How long `kill()` waits for the killed workers to end.
_KILL_WAIT_S = 5.0
_KILL_POLL_S = 0.05


class GrainWorkers:
    """The `mp_prefetch` workers of one Grain iterator, seen from the training process.

    Create it in the training process, hand it to the workers by pickling
    (`init_grain_worker(..., workers=...)` registers each) and `close()` it
    once they stopped. Its methods are safe to call from several threads.

    Args:
      count: W, the iterator's workers; worker w prepares the batches
        `b = w, w + W, ...` below `num_batches`.
      num_batches: N, the batches of the input.
    """

    def __init__(self, count: int, num_batches: int):
        self._count = count
        self._num_batches = num_batches
        self._lock = threading.Lock()
        self._pids: dict[int, int] = {}
        # The workers that made the last batch of their share.
        self._made_last: set[int] = set()
        # The batch the input waits for, as last checked.
        self._due = 0
        self._processes: dict[int, multiprocessing.process.BaseProcess] = {}
        # How each worker that ended ended (`Process.exitcode`, None: unknown),
        # kept: its `Process` may be collected.
        self._exits: dict[int, int | None] = {}
        # The pipes each worker had open, seen while it ran.
        self._pipes: dict[int, frozenset[int]] = {}
        self._read_fd: int | None = None
        self._write_fd: int | None = None
        self._path: str | None = None
        self._identity: tuple[int, int] | None = None
        if os.path.isdir(f"/proc/{os.getpid()}/fd"):
            self._read_fd, self._write_fd = os.pipe()
            os.set_blocking(self._read_fd, False)
            self._path = f"/proc/{os.getpid()}/fd/{self._write_fd}"
            status = os.fstat(self._write_fd)
            self._identity = (status.st_dev, status.st_ino)

    def register(self, index: int) -> None:
        """In worker `index`: tells the training process this process's pid."""
        self._report(index, _STARTED)

    def made_last_batch(self, index: int) -> None:
        """In worker `index`: tells the training process its share's last batch is made."""
        self._report(index, _MADE_LAST_BATCH)

    def check(self, due: int, *, after_error: bool = False) -> None:
        """Raises if a worker has ended.

        Args:
          due: the batch the input waits for (named in the error).
          after_error: Grain passed on a worker's own error, after which it
            stops that worker: a worker whose status is unknown (collected by
            Grain) is then no failure of its own.

        Raises:
          InputWorkerError: a worker ended (killed, crashed or exited) before
            it was done; the message names it, its pid and how it ended.
        """
        with self._lock:
            self._due = due
            self._update()
            failed = self._failed()
        if after_error:
            failed = {index: code for index, code in failed.items() if code is not None}
        if not failed:
            return
        workers = "; ".join(
            f"{self._name(index)} (pid {self._pids[index]}) {_exit_description(code)}"
            for index, code in failed.items()
        )
        hint = (
            " SIGKILL is what the kernel's out-of-memory killer sends: see its log (dmesg)."
            if -signal.SIGKILL in failed.values()
            else ""
        )
        raise InputWorkerError(
            f"{workers}, while the input needed it (batch {due} was due); the input cannot "
            f"go on without its workers.{hint}"
        )

    def any_failed(self) -> bool:
        """Whether a worker has ended before it was done."""
        with self._lock:
            self._update()
            return bool(self._failed())

    def describe(self, batch_number: int) -> str:
        """Who prepares batch `batch_number`: `Grain worker 1 of 2 (pid 3220, stopped)`."""
        index = batch_number % self._count
        with self._lock:
            self._update()
            pid = self._pids.get(index)
            ended = index in self._exits
            code = self._exits.get(index)
        if pid is None:
            return f"{self._name(index)} (which has not reported its pid)"
        how = _exit_description(code) if ended else _state(pid)
        return f"{self._name(index)} (pid {pid}, {how})"

    def kill(self) -> None:
        """Kills every worker still running (SIGKILL) and waits a little for them to end.

        A killed worker may have been sending a batch: its pipes are let go
        of as it is seen ended.
        """
        with self._lock:
            self._update()
            for index, pid in self._pids.items():
                if index not in self._exits:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + _KILL_WAIT_S
        while time.monotonic() < deadline:
            with self._lock:
                self._update()
                if self._exits.keys() >= self._pids.keys():
                    return
            time.sleep(_KILL_POLL_S)

    def close(self) -> None:
        """Stops taking reports (in the training process)."""
        with self._lock:
            for fd in (self._read_fd, self._write_fd):
                if fd is not None:
                    os.close(fd)
            self._read_fd = self._write_fd = None

    def __getstate__(self) -> dict:
        # A worker's copy only reports.
        return {"_count": self._count, "_path": self._path, "_identity": self._identity}

    def _report(self, index: int, event: int) -> None:
        """In worker `index`: writes a report to the training process's pipe."""
        if self._path is None:
            return
        try:
            fd = os.open(self._path, os.O_WRONLY)
        except OSError as error:
            _log.warning("Grain worker %d cannot report to the trainer (%s).", index, error)
            return
        try:
            # A closed descriptor's number may name another file since.
            status = os.fstat(fd)
            if (status.st_dev, status.st_ino) == self._identity:
                os.write(fd, _REPORT.pack(index, os.getpid(), event))
        finally:
            os.close(fd)

    def _name(self, index: int) -> str:
        return f"Grain worker {index} of {self._count}"

    def _done(self, index: int) -> bool:
        """Whether worker `index` may end: its share is made, or taken whole."""
        last = index + self._count * ((self._num_batches - 1 - index) // self._count)
        return index in self._made_last or self._due > last

    def _failed(self) -> dict[int, int | None]:
        """`{index: exit code}` of the workers that ended before they were done, by index."""
        return {index: code for index, code in sorted(self._exits.items()) if self._failure(index)}

    def _failure(self, index: int) -> bool:
        """Whether worker `index`, which ended, ended before it was done."""
        code = self._exits[index]
        return code != 0 and (code is not None or not self._done(index))

    def _take_reports(self) -> None:
        try:
            data = os.read(self._read_fd, 64 * _REPORT.size)
        except BlockingIOError:
            data = b""
        for index, pid, event in _REPORT.iter_unpack(data):
            if event == _MADE_LAST_BATCH:
                self._made_last.add(index)
                continue
            # A worker started again is a new process.
            self._pids[index] = pid
            self._processes.pop(index, None)
            self._exits.pop(index, None)
            self._made_last.discard(index)
            self._pipes[index] = pipe_inodes(pid) - {self._identity[1]}

    def _update(self) -> None:
        """Takes new reports, matches workers to their `Process`, notes the ones that ended."""
        if self._read_fd is None:
            return
        self._take_reports()
        ended: dict[int, tuple[int, int | None]] = {}
        unmatched = {
            pid: index
            for index, pid in self._pids.items()
            if index not in self._processes and index not in self._exits
        }
        # Before `active_children()`, which collects the children that ended.
        for pid, index in list(unmatched.items()):
            exited, code = _unmatched_exit(pid)
            if exited:
                ended[index] = (pid, code)
                del unmatched[pid]
        if unmatched:
            for process in multiprocessing.active_children():
                if process.pid in unmatched:
                    self._processes[unmatched[process.pid]] = process
        for index, process in self._processes.items():
            if index not in self._exits and process.exitcode is not None:
                ended[index] = (process.pid, process.exitcode)
        if not ended:
            return
        # A worker reports its last batch before it ends: seen ended now, its
        # report is in the pipe now.
        self._take_reports()
        for index, (pid, code) in ended.items():
            if self._pids[index] == pid:
                self._ended(index, code)

    def _ended(self, index: int, code: int | None) -> None:
        """Notes that worker `index` ended with `Process.exitcode` `code` (None: unknown)."""
        self._exits[index] = code
        pipes = self._pipes.pop(index, frozenset())
        # One that was done sent whole batches; another may have been killed
        # in the middle of one.
        if self._failure(index):
            let_go(pipes)


def _unmatched_exit(pid: int) -> tuple[bool, int | None]:
    """`(ended, exit code as Process.exitcode or None if unknown)` of a child process."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # collected by another
        return True, None
    if info is None:
        return False, None
    signalled = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
    return True, -info.si_status if signalled else info.si_status


def _exit_description(code: int | None) -> str:
    """`Process.exitcode` in words: `was killed by signal 9 (SIGKILL)`, `exited with status 1`."""
    if code is None:
        return "has ended"
    if code >= 0:
        return f"exited with status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "unknown signal"
    return f"was killed by signal {-code} ({name})"


def _state(pid: int) -> str:
    """A running process's scheduling state (`sleeping`, `running`, `stopped`, ...)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("State:"):
                    return line.split("(", 1)[-1].rstrip(")\n")
    except OSError:
        pass
    return "alive"
