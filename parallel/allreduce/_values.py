"""The two kinds of reduced values and their checks.

A value is held as a Python int: 0/1 for `BOOL`, [0, 2**64) for `UINT64`. The
reduction is OR for both (bitwise OR for `UINT64`), so it is associative,
commutative and idempotent: the order in which contributions arrive never
changes the result.
"""

from __future__ import annotations

import enum
import operator

import numpy as np

UINT64_MAX = 2**64 - 1
UINT32_MAX = 2**32 - 1


class ValueKind(enum.Enum):
    """The type of the values reduced under one sync key."""

    BOOL = "bool"
    UINT64 = "uint64"


def check_sync_key(sync_key: int) -> int:
    """The key as an int in [0, 2**64); `TypeError`/`ValueError` otherwise."""
    return _in_uint64_range(sync_key, "sync_key must be an integer", "sync_key must be in")


def as_bool(value: object) -> int:
    """A bool value as 0/1; `TypeError` for anything but bool or numpy bool."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(
            f"all_reduce_bool needs a bool value, got {type(value).__name__} {value!r}; "
            "use all_reduce_uint64 for integer masks."
        )
    return int(bool(value))


def as_uint64(value: object) -> int:
    """An integer value in [0, 2**64); `TypeError`/`ValueError` otherwise."""
    return _in_uint64_range(
        value,
        "all_reduce_uint64 needs an integer value",
        "all_reduce_uint64 needs a value in",
        bool_hint="; use all_reduce_bool for flags",
    )


def _in_uint64_range(
    value: object, needs_integer: str, needs_range: str, bool_hint: str = ""
) -> int:
    """`value` as an int in [0, 2**64).

    Raises:
      TypeError: `value` is a bool (`"{needs_integer}, got the bool ...{bool_hint}."`)
        or not an integer (`"{needs_integer}, got <type> ..."`).
      ValueError: `value` is out of range (`"{needs_range} [0, 2**64), got ..."`).
    """
    if isinstance(value, bool | np.bool_):
        raise TypeError(f"{needs_integer}, got the bool {value!r}{bool_hint}.")
    try:
        number = operator.index(value)
    except TypeError as e:
        raise TypeError(f"{needs_integer}, got {type(value).__name__} {value!r}.") from e
    if not 0 <= number <= UINT64_MAX:
        raise ValueError(f"{needs_range} [0, 2**64), got {number}.")
    return number


def infer(value: object) -> tuple[ValueKind, int]:
    """The kind and held form of a bool or unsigned integer value."""
    if isinstance(value, bool | np.bool_):
        return ValueKind.BOOL, as_bool(value)
    return ValueKind.UINT64, as_uint64(value)


def to_python(kind: ValueKind, held: int) -> bool | int:
    """The held form back as the caller's type: `bool` or `int`."""
    return bool(held) if kind is ValueKind.BOOL else held
