"""How many memory mappings this process holds, against what Linux allows (/proc)."""

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
