"""Runs of compared setups in alternating order, for benchmarks that compare whole runs.

On a shared machine the load drifts within a run. Running setups A, B, ...
once each in turn puts the drift into their ratio; passing over them
forwards, then backwards (A B B A A B ...) spreads it over all of them.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


def add_repeats_argument(parser: argparse.ArgumentParser) -> None:
    """Adds `--repeats` (default 2): the passes over the compared setups."""
    parser.add_argument("--repeats", type=_at_least_one, default=2)


def alternating(setups: Sequence[T], repeats: int) -> Iterator[tuple[int, T]]:
    """`(repeat, setup)` for `repeats` passes over `setups`, every other pass reversed."""
    for repeat in range(repeats):
        for setup in setups if repeat % 2 == 0 else setups[::-1]:
            yield repeat, setup


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
