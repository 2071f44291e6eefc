"""The columns of an import: names, value types, which one is the label.

A column's kind says how a field becomes a `tf.train.Example` feature:

  int     an int64 feature (one value)        a field must be a base-10 integer
  float   a float feature (one value)         a field must be a finite number
  string  a bytes feature (the UTF-8 bytes)   any field
  hex     a bytes feature (the field's bytes) a field must be hexadecimal digits

An empty field is left out of the Example (a parser reading the key as a
VarLenFeature sees no value). The label column is written under the key
`label` (int64 or float); an empty label makes the line a dead letter.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from embedding import SparseflowError

LABEL_KEY = "label"


class ColumnSpecError(SparseflowError, ValueError):
    """Columns or import settings that cannot be used; the message says which."""


class ColumnKind(str, enum.Enum):
    """How a column's fields are checked and written."""

    INT = "int"
    FLOAT = "float"
    STRING = "string"
    HEX = "hex"


@dataclasses.dataclass(frozen=True)
class Column:
    """One column: its name (the feature key) and kind."""

    name: str
    kind: ColumnKind

    def __post_init__(self):
        if not self.name:
            raise ColumnSpecError("A column needs a name.")
        object.__setattr__(self, "kind", _kind(self.kind, self.name))


@dataclasses.dataclass(frozen=True)
class ColumnSpec:
    """The columns of every line, in order, and which one is the label.

    Attributes:
      columns: the columns, in field order.
      label: the name of the label column (kind int or float), written as
        `label`; None: the records have no label.
    """

    columns: tuple[Column, ...]
    label: str | None = None

    def __post_init__(self):
        columns = tuple(self.columns)
        object.__setattr__(self, "columns", columns)
        if not columns:
            raise ColumnSpecError("The column spec has no columns.")
        names = [column.name for column in columns]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ColumnSpecError(f"Columns {repeated} are named twice.")
        if self.label is None:
            if LABEL_KEY in names:
                raise ColumnSpecError(
                    f"A column is named {LABEL_KEY!r} but is not the label; rename it or make "
                    "it the label."
                )
            return
        if self.label not in names:
            raise ColumnSpecError(
                f"The label column {self.label!r} is not among the columns {names}."
            )
        if self.label != LABEL_KEY and LABEL_KEY in names:
            raise ColumnSpecError(
                f"Column {LABEL_KEY!r} would clash with the label {self.label!r}, written as "
                f"{LABEL_KEY!r}."
            )
        kind = columns[names.index(self.label)].kind
        if kind not in (ColumnKind.INT, ColumnKind.FLOAT):
            raise ColumnSpecError(
                f"The label column {self.label!r} must be int or float, not {kind}."
            )

    @property
    def names(self) -> list[str]:
        return [column.name for column in self.columns]

    def feature_key(self, column: Column) -> str:
        """The Example key a column is written under."""
        return LABEL_KEY if column.name == self.label else column.name


def criteo_spec() -> ColumnSpec:
    """The Criteo click logs: label, 13 integer counts, 26 hashed categories (hex)."""
    columns = (
        [Column(LABEL_KEY, ColumnKind.INT)]
        + [Column(f"int_{i}", ColumnKind.INT) for i in range(1, 14)]
        + [Column(f"cat_{i}", ColumnKind.HEX) for i in range(1, 27)]
    )
    return ColumnSpec(tuple(columns), label=LABEL_KEY)


def parse_columns(text: str) -> list[Column]:
    """Columns from `name:kind,name:kind,...` (a bare `name` is a string column).

    Raises:
      ColumnSpecError: an unknown kind or an empty name (the entry named).
    """
    columns = []
    for entry in text.split(","):
        name, _, kind = entry.strip().partition(":")
        if not name.strip():
            raise ColumnSpecError(f"Column entry {entry!r} of {text!r} has no name.")
        columns.append(Column(name.strip(), kind.strip() or ColumnKind.STRING))
    return columns


def spec_from_names(
    names: Sequence[str], kinds: Sequence[Column] = (), label: str | None = None
) -> ColumnSpec:
    """A spec for columns named by a header: kinds from `kinds` (by name), else string.

    Raises:
      ColumnSpecError: `kinds` names a column the header does not have.
    """
    given = {column.name: column.kind for column in kinds}
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ColumnSpecError(
            f"Columns {unknown} are given kinds but are not in the header {names}."
        )
    return ColumnSpec(
        tuple(Column(name, given.get(name, ColumnKind.STRING)) for name in names), label=label
    )


def _kind(kind, name: str) -> ColumnKind:
    try:
        return ColumnKind(kind)
    except ValueError:
        known = ", ".join(k.value for k in ColumnKind)
        raise ColumnSpecError(f"Column {name!r}: unknown kind {kind!r} (known: {known}).") from None
