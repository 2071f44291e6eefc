"""This process's memory as /proc tells it: its mappings against what Linux
allows, its resident and peak bytes."""

from pathlib import Path


def memory_maps() -> int:
    """The memory mappings this process holds (lines of /proc/self/maps)."""
    return Path("/proc/self/maps").read_bytes().count(b"\n")


def memory_maps_over(share: float) -> bool:
    """Whether this process holds more than `share` of the memory mappings Linux
    allows one process (`vm.max_map_count`); False where /proc does not say."""
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
        count = memory_maps()
    except (OSError, ValueError):
        return False
    return count > share * limit


def status_bytes(field: str) -> int:
    """A memory figure of this process (`VmRSS`, `VmHWM`: its peak) from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")
