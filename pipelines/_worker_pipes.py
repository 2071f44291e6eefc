"""Letting go of the pipes a dead worker process shared with this process (Linux).

A `multiprocessing.Queue` keeps both ends of its pipe in the process that
created it. So when the worker that writes to it dies in the middle of a
message (a batch larger than the pipe's buffer: the worker waited for the
reader to make room), the reader sees no end of file: it waits for the rest
forever, and so does everything that empties the queue later (Grain's close
of the iterator, and multiprocessing's at exit).

Once the worker is dead, `let_go` turns this process's ends of every pipe it
shared with the worker and holds both ends of (the queues') into ends that
cannot block: a write end into /dev/null, so that a reader waiting for the
rest sees an end of file, and a read end into one of a pipe that stays
empty and never blocks, so that a later read finds nothing. The descriptor
numbers stay valid for their owners to close.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import threading

_PIPE = re.compile(r"pipe:\[(\d+)\]")
# The empty pipe whose read end stands in for a dead worker's: its write end
# stays open, so that reading it gives "nothing yet", not an end of file.
_empty: tuple[int, int] | None = None
_empty_lock = threading.Lock()


def pipe_inodes(pid: int) -> frozenset[int]:
    """The pipes process `pid` has open, by inode (none where /proc does not show them)."""
    return frozenset(_open_pipes(f"/proc/{pid}/fd").values())


def let_go(inodes: frozenset[int]) -> None:
    """Makes this process's ends of the pipes `inodes` (a dead process's) unable to block.

    Only pipes this process holds both ends of are changed: the other end of
    one it holds a single end of is another live process's.
    """
    ends: dict[int, list[tuple[int, int]]] = {}
    for fd, inode in _open_pipes("/proc/self/fd").items():
        if inode in inodes:
            with contextlib.suppress(OSError):
                ends.setdefault(inode, []).append(
                    (fd, fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE)
                )
    for inode, pipe_ends in ends.items():
        if {mode for _, mode in pipe_ends} != {os.O_RDONLY, os.O_WRONLY}:
            continue
        for fd, mode in pipe_ends:
            if _inode(fd) != inode:  # closed since the listing, maybe reused
                continue
            if mode == os.O_WRONLY:
                null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
                os.dup2(null, fd, inheritable=False)
                os.close(null)
            else:
                os.dup2(_empty_read_end(), fd, inheritable=False)


def _open_pipes(directory: str) -> dict[int, int]:
    """`{descriptor: pipe inode}` of the pipes in a /proc `fd` directory."""
    try:
        names = os.listdir(directory)
    except OSError:
        return {}
    pipes = {}
    for name in names:
        with contextlib.suppress(OSError):
            match = _PIPE.fullmatch(os.readlink(f"{directory}/{name}"))
            if match:
                pipes[int(name)] = int(match[1])
    return pipes


def _inode(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def _empty_read_end() -> int:
    global _empty
    with _empty_lock:
        if _empty is None:
            read, write = os.pipe()
            os.set_blocking(read, False)
            _empty = (read, write)
        return _empty[0]
