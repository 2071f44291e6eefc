"""Strict reading of a parsed JSON document, every failure naming its entry.

Entries are named as a reader would look them up: fixed fields with a dot
(`geometry.devices`), free names and list positions in brackets
(`stacks['t'].max_ids_per_partition[3]`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from embedding._errors import SparseflowError

INT64_MAX = 2**63 - 1


class SchemaError(SparseflowError, ValueError):
    """An entry of the wrong type, size or value.

    Args:
      entry: where, e.g. `stacks['t'].max_ids_per_partition[3]` ("" for the
        document itself).
      problem: what is wrong, with the value found.
    """

    def __init__(self, entry: str, problem: str):
        super().__init__(f"{entry}: {problem}" if entry else problem)


def field(entry: str, key: str) -> str:
    """The name of a fixed field of an object."""
    return f"{entry}.{key}" if entry else key


def item(entry: str, key: str | int) -> str:
    """The name of a freely named member of an object, or of a list position."""
    return f"{entry}[{key!r}]"


def json_object(
    value: Any, entry: str, *, required: Collection[str] = (), optional: Collection[str] = ()
) -> dict[str, Any]:
    """`value` as an object with the `required` keys and no key outside `optional`.

    With neither given, the keys are free names (of stacks, of tables).
    """
    if not isinstance(value, dict):
        raise SchemaError(entry, f"must be an object, got {type(value).__name__}")
    if required or optional:
        unknown = [key for key in value if key not in required and key not in optional]
        if unknown:
            raise SchemaError(entry, f"unknown entry {unknown[0]!r}")
        missing = [key for key in required if key not in value]
        if missing:
            raise SchemaError(entry, f"missing entry {missing[0]!r}")
    return value


def integer(value: Any, entry: str, *, high: int) -> int:
    """`value` as an integer in `[0, high]`; booleans and floats such as 2.0 are refused."""
    # JSON's true is Python's True, an int: only the exact type passes.
    if type(value) is not int or not 0 <= value <= high:
        raise SchemaError(entry, f"must be an integer in [0, {high}], got {value!r}")
    return value


def json_list(value: Any, entry: str, *, length: int | None = None, of: str = "items") -> list:
    """`value` as a list (of `length` items if given); `of` names the items."""
    if not isinstance(value, list) or (length is not None and len(value) != length):
        size = "" if length is None else f"{length} "
        got = f"a list of {len(value)}" if isinstance(value, list) else type(value).__name__
        raise SchemaError(entry, f"must be a list of {size}{of}, got {got}")
    return value


def integers(value: Any, entry: str, *, high: int, length: int | None = None) -> list[int]:
    """`value` as a list of integers in `[0, high]` (of `length` if given)."""
    values = json_list(value, entry, length=length, of="integers")
    return [integer(v, item(entry, i), high=high) for i, v in enumerate(values)]
