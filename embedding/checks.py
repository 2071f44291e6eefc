"""Argument checks shared by every package (`embedding.checks`; embedding is imported by all).

An integer check that also rejects `bool` (a subclass of `int`): `True`
passed for a count is a mistake, not 1.
"""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    """True for an `int` that is not a `bool`."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: Any, what: str, minimum: int) -> None:
    """Raises ValueError unless `value` is an integer >= `minimum`."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}.")


def check_positive_int(value: Any, what: str) -> None:
    """Raises ValueError unless `value` is an integer >= 1."""
    if not is_int(value) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}.")
