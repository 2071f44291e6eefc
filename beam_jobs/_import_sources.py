"""The input files of an import, cut into ranges that workers read independently.

A text file (CSV, TSV) is cut into byte ranges: a range holds the lines that
start inside it, so every line belongs to exactly one range whatever the cut.
A Parquet file is cut into its row groups. A range's rows are counted in a
first pass; the counts of the earlier ranges give a row its line number.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Iterator

from beam_jobs._columns import Column, ColumnKind, ColumnSpec
from pipelines import DataError

DEFAULT_BYTES_PER_RANGE = 64 * 2**20


class InputFormat(str, enum.Enum):
    """How the input files are read."""

    TEXT = "text"
    PARQUET = "parquet"


@dataclasses.dataclass(frozen=True)
class InputRange:
    """Part of one input file.

    Attributes:
      file_index: the file's position among the inputs.
      path: the file.
      index: the range's position within the file.
      start, stop: bytes `[start, stop)` of a text file; row group `start`
        of a Parquet file (`stop = start + 1`).
    """

    file_index: int
    path: str
    index: int
    start: int
    stop: int

    @property
    def key(self) -> tuple[int, int]:
        return self.file_index, self.index


def input_ranges(
    paths: list[str], fmt: InputFormat, bytes_per_range: int = DEFAULT_BYTES_PER_RANGE
) -> list[InputRange]:
    """The ranges of all files, in file order."""
    ranges = []
    for file_index, path in enumerate(paths):
        if fmt is InputFormat.PARQUET:
            bounds = [(g, g + 1) for g in range(_parquet_file(path).num_row_groups)]
        else:
            size = os.path.getsize(path)
            bounds = [
                (start, min(size, start + bytes_per_range))
                for start in range(0, size, bytes_per_range)
            ]
        ranges.extend(
            InputRange(file_index, path, index, start, stop)
            for index, (start, stop) in enumerate(bounds)
        )
    return ranges


def read_rows(input_range: InputRange, fmt: InputFormat, header: bool) -> Iterator:
    """Yields the range's rows: a text line's bytes, or a Parquet row's values."""
    if fmt is InputFormat.PARQUET:
        yield from _parquet_rows(input_range)
    else:
        yield from _text_rows(input_range, header)


def count_rows(input_range: InputRange, fmt: InputFormat, header: bool) -> int:
    """The rows of a range (a Parquet row group's from its metadata)."""
    if fmt is InputFormat.PARQUET:
        return _parquet_file(input_range.path).metadata.row_group(input_range.start).num_rows
    return sum(1 for _ in _text_rows(input_range, header))


def first_line(path: str) -> bytes:
    """The first line of a text file (the header), without its line ending."""
    with open(path, "rb") as file:
        return file.readline().rstrip(b"\r\n")


def _text_rows(input_range: InputRange, header: bool) -> Iterator[bytes]:
    """The lines starting in `[start, stop)` (a header line left out)."""
    with open(input_range.path, "rb") as file:
        position = input_range.start
        if position > 0:
            # The rest of the line running into the range belongs to the previous one.
            file.seek(position - 1)
            position += len(file.readline()) - 1
        elif header:
            position += len(file.readline())
        while position < input_range.stop:
            line = file.readline()
            if not line:
                return
            yield line
            position += len(line)


def _parquet_file(path: str):
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError as e:
        raise DataError(f"Reading Parquet files needs pyarrow: pip install pyarrow ({e}).") from e
    try:
        return pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: not a readable Parquet file: {e}") from e


def _parquet_rows(input_range: InputRange) -> Iterator[list]:
    table = _parquet_file(input_range.path).read_row_group(input_range.start)
    columns = [column.to_pylist() for column in table.columns]
    yield from (list(row) for row in zip(*columns))


def parquet_spec(path: str, label: str | None) -> ColumnSpec:
    """The column spec of a Parquet file's schema.

    Integer and boolean columns are int, floating ones float, string and
    binary ones string.

    Raises:
      DataError: a column of another type (named).
      ColumnSpecError: a bad label.
    """
    import pyarrow as pa

    columns = []
    for field in _parquet_file(path).schema_arrow:
        t = field.type
        if pa.types.is_integer(t) or pa.types.is_boolean(t):
            kind = ColumnKind.INT
        elif pa.types.is_floating(t):
            kind = ColumnKind.FLOAT
        elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t):
            kind = ColumnKind.STRING
        else:
            raise DataError(
                f"{path}: column {field.name!r} has type {t}; the import reads integer, "
                "floating, boolean, string and binary columns."
            )
        columns.append(Column(field.name, kind))
    return ColumnSpec(tuple(columns), label=label)
