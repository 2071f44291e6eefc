"""One line (or Parquet row) -> a serialized `tf.train.Example`, or why it is bad.

Lines are split on the delimiter: a tab splits plainly (TSV, Criteo), a comma
through Python's `csv` module (quoted fields may hold commas; a record is
one line). The fields are checked against the `ColumnSpec` (see
`beam_jobs._columns` for what each kind accepts).
"""

from __future__ import annotations

import csv
import functools
import math
import re
from collections.abc import Sequence

from beam_jobs._columns import ColumnKind, ColumnSpec, ColumnSpecError
from beam_jobs._example_encoder import ExampleEncoder

_HEX = re.compile(r"[0-9a-fA-F]+")
# Python's int() and float() also take spaces, "_" separators and non-ASCII digits.
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_FLOAT32_MAX = 3.4028234663852886e38
_MAX_SHOWN_CHARS = 40


class BadLine(ValueError):
    """A line that cannot become a record; the message says why."""


class LineParser:
    """Turns the lines of one column spec into Examples.

    Args:
      spec: the columns.
      delimiter: the field separator (`"\\t"` or `","`, or any one character).
    """

    def __init__(self, spec: ColumnSpec, delimiter: str):
        if len(delimiter) != 1:
            raise ColumnSpecError(f"The delimiter must be one character, got {delimiter!r}.")
        self._spec = spec
        self._delimiter = delimiter
        self._kinds = [column.kind for column in spec.columns]
        self._names = spec.names
        self._converters = [
            functools.partial(_CONVERTERS[column.kind], name=column.name) for column in spec.columns
        ]
        self._encoder = ExampleEncoder(
            [spec.feature_key(column) for column in spec.columns], self._kinds
        )
        self._label = spec.names.index(spec.label) if spec.label is not None else None

    def fields(self, line: bytes) -> list[str]:
        """The fields of a line (its line ending removed).

        Raises:
          BadLine: the line is not UTF-8, or its field count is wrong.
        """
        fields = split_line(line, self._delimiter)
        if len(fields) != len(self._kinds):
            raise BadLine(f"{len(fields)} columns, expected {len(self._kinds)}")
        return fields

    def values(self, fields: Sequence[str]) -> list:
        """Per column its value (int, float or str), None for an empty field.

        Raises:
          BadLine: a field that its column's kind rejects, or an empty label.
        """
        values = [
            convert(field) if field else None
            for convert, field in zip(self._converters, fields, strict=True)
        ]
        self.check_label(values)
        return values

    def check_row(self, values: Sequence) -> None:
        """Checks typed values (a Parquet row): finite floats, a label.

        Raises:
          BadLine: a NaN or infinite float, or an empty label.
        """
        for value, name in zip(values, self._names, strict=True):
            if isinstance(value, float):
                _check_float(value, name, value)
        self.check_label(values)

    def check_label(self, values: Sequence) -> None:
        """Raises BadLine when the label is missing."""
        if self._label is None:
            return
        label = values[self._label]
        if label is None:
            raise BadLine(f"empty label column {self._spec.label!r}")

    def example(self, values: Sequence) -> bytes:
        """The serialized Example of a line's values (None values left out)."""
        return self._encoder.encode(values)


def split_line(line: bytes, delimiter: str) -> list[str]:
    """The fields of a line (its line ending removed); a comma splits as CSV.

    Raises:
      BadLine: the line is not UTF-8.
    """
    try:
        text = line.decode().rstrip("\r\n")
    except UnicodeDecodeError as error:
        raise BadLine(f"not UTF-8: {error.reason} at byte {error.start}") from None
    if delimiter == ",":
        return next(csv.reader([text]), [])
    return text.split(delimiter)


def _int(field: str, name: str) -> int:
    # isdigit alone takes non-ASCII digits; the regex is the slow path for signs.
    if not (field.isascii() and field.isdigit()) and not _INT.fullmatch(field):
        raise BadLine(f"column {name!r}: {_shown(field)} is not an integer")
    value = int(field)
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise BadLine(f"column {name!r}: {_shown(field)} is outside int64")
    return value


def _float(field: str, name: str) -> float:
    if not _FLOAT.fullmatch(field):
        raise BadLine(f"column {name!r}: {_shown(field)} is not a number")
    value = float(field)
    _check_float(value, name, _shown(field))
    return value


def _check_float(value: float, name: str, shown) -> None:
    """Float features are float32: a value past its range would be written as infinite."""
    if not math.isfinite(value):
        raise BadLine(f"column {name!r}: {shown} is not finite")
    if abs(value) > _FLOAT32_MAX:
        raise BadLine(f"column {name!r}: {shown} is outside float32")


def _string(field: str, name: str) -> str:
    return field


def _hex(field: str, name: str) -> str:
    if not _HEX.fullmatch(field):
        raise BadLine(f"column {name!r}: {_shown(field)} is not hexadecimal")
    return field


_CONVERTERS = {
    ColumnKind.INT: _int,
    ColumnKind.FLOAT: _float,
    ColumnKind.STRING: _string,
    ColumnKind.HEX: _hex,
}


def _shown(field: str) -> str:
    if len(field) > _MAX_SHOWN_CHARS:
        field = field[:_MAX_SHOWN_CHARS] + "..."
    return repr(field)
