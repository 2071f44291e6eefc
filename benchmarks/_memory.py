"""Resident memory of this process, from /proc (Linux), for the benchmarks that
report it. Standard library only."""

from __future__ import annotations

from pathlib import Path


def resident_bytes() -> dict[str, int]:
    """`rss`: resident now; `peak_rss`: the highest since the process started or
    since the last `reset_peak()` (the kernel's VmRSS and VmHWM)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields["rss" if name == "VmRSS" else "peak_rss"] = int(value.split()[0]) * 1024
    return fields


def reset_peak() -> None:
    """Starts a new peak at the resident size now (writing 5 to clear_refs, Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")
