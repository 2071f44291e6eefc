"""`-n auto`'s worker count: the cores a process may run on, within the memory."""

import os
import subprocess
import sys
from pathlib import Path

import worker_count

TESTS = Path(__file__).resolve().parent


def test_the_cores_are_those_the_process_may_run_on():
    pinned = (
        "import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        f"sys.path.insert(0, {str(TESTS)!r}); import worker_count; "
        "print(worker_count.usable_cores(), worker_count.worker_count())"
    )
    out = subprocess.run([sys.executable, "-c", pinned], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1"]


def test_no_more_workers_than_the_memory_holds(monkeypatch):
    monkeypatch.setattr(worker_count, "usable_cores", lambda: 16)
    monkeypatch.setattr(worker_count, "available_memory", lambda: 3 * worker_count.WORKER_MEMORY)
    assert worker_count.worker_count() == 3
    monkeypatch.setattr(worker_count, "available_memory", lambda: worker_count.WORKER_MEMORY // 2)
    assert worker_count.worker_count() == 1
    monkeypatch.setattr(worker_count, "available_memory", lambda: None)
    assert worker_count.worker_count() == 16


def test_a_cgroup_quota_caps_the_cores(monkeypatch):
    monkeypatch.setattr(worker_count, "_cpu_quota", lambda: 2.5)
    assert worker_count.usable_cores() == min(3, len(os.sched_getaffinity(0)))
    # Under one core's worth: one, whatever the affinity allows.
    monkeypatch.setattr(worker_count, "_cpu_quota", lambda: 0.5)
    assert worker_count.usable_cores() == 1
