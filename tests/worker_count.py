"""How many test processes this machine runs at once (`-n auto`)."""

import math
import os
from pathlib import Path

# What one test process may hold at its peak with the processes its tests
# start (an 8-device training in a subprocess, a group of 4 processes), in
# bytes: workers beyond what the memory holds would be killed by the kernel.
WORKER_MEMORY = 6 * 2**30


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, within a cgroup's
    CPU quota where one is set (a container often shows every core of its
    host and runs on a few of them)."""
    cores = len(os.sched_getaffinity(0))
    quota = _cpu_quota()
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


def _cpu_quota() -> float | None:
    """The cgroup's CPU quota in cores (v2's cpu.max, v1's CFS files), or None."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        folder = Path("/sys/fs/cgroup/cpu")
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def available_memory() -> int | None:
    """Bytes of memory available to new processes (/proc/meminfo), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def worker_count() -> int:
    """One test process per usable core, no more than the memory holds."""
    cores, memory = usable_cores(), available_memory()
    return cores if memory is None else max(1, min(cores, memory // WORKER_MEMORY))
