"""Timing steps over a fixed set of batches (standard library only: both
sides of the lookup benchmark import it, ours and the TorchRec peer)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any


def step_times(
    run_step: Callable[[Any], None], batches: Sequence[Any], first: int, steps: int
) -> list[float]:
    """Milliseconds of `run_step(batch)` (which waits for its result) for
    `steps` batches, cycling through `batches` from index `first`."""
    times = []
    for index in range(first, first + steps):
        start = time.perf_counter()
        run_step(batches[index % len(batches)])
        times.append((time.perf_counter() - start) * 1e3)
    return times


def best_of(repeats: int, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """(the last result, the shortest of `repeats` wall times in seconds) of `fn(*args)`:
    others' load on the machine only adds time."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn(*args)
        times.append(time.perf_counter() - start)
    return result, min(times)
