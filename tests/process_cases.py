"""Processes in tests: whether one lives and a process's Grain workers (from /proc), a child's work.

Light on imports: a spawned child imports this module to run `send_and_wait`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def _state_and_parent(pid: int) -> tuple[str, int] | None:
    """`(state letter, parent pid)` of a process, or None when it is gone."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return None
    # `pid (name) state ppid ...`; the name may hold spaces and parentheses.
    state, ppid = stat.rsplit(")", 1)[1].split()[:2]
    return state, int(ppid)


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie, ended but not collected, does not)."""
    status = _state_and_parent(pid)
    return status is not None and status[0] not in "ZX"


def grain_workers(parent: int) -> list[int]:
    """The live processes `parent` spawned with multiprocessing: its Grain workers."""
    workers = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        status = _state_and_parent(pid)
        if status is None or status[1] != parent or not alive(pid):
            continue
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing.spawn" in command:
            workers.append(pid)
    return workers


def wait_for(condition: Callable[[], T], timeout_s: float, failure: str) -> T:
    """The first truthy value of `condition()`, polled; fails with `failure` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{failure} within {timeout_s:.0f} s")


def send_and_wait(queue, sent, seconds: float) -> None:
    """In a child: puts a message larger than a pipe's buffer on `queue`, sets `sent`, waits."""
    queue.put(b"x" * (1 << 20))
    sent.set()
    time.sleep(seconds)
