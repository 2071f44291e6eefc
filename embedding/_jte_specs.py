"""jax-tpu-embedding's `TableSpec` constructor and `QuantizationConfig`, for `jte_compat`.

The reference builds a table already placed in a stack with
`TableSpec(..., _setting_in_stack=..., _stacked_table_spec=...)` and
describes quantized tables with `quantization_config=`. Here `TableSpec` is
`embedding.TableSpec` with those keywords; a quantized table compares and
hashes by its config but is refused once it is placed in a stack (every
lookup, update and layout places it), since sparseflow keeps every table in
float32.
"""

from __future__ import annotations

import dataclasses

from embedding._specs import StackedTableSpec, TableSettingInStack
from embedding._specs import TableSpec as _TableSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizationConfig:
    """The reference's per-table quantization: `num_buckets` levels over
    `[min_value, max_value]`.

    Raises:
      ValueError: `num_buckets < 2` or `min_value >= max_value`.
    """

    min_value: float
    max_value: float
    num_buckets: int

    def __post_init__(self) -> None:
        if self.num_buckets < 2:
            raise ValueError(
                f"QuantizationConfig: num_buckets must be >= 2, got {self.num_buckets}."
            )
        if self.min_value >= self.max_value:
            raise ValueError(
                f"QuantizationConfig: min_value ({self.min_value}) must be < max_value "
                f"({self.max_value})."
            )

    def as_tuple(self) -> tuple[float, float, int]:
        """`(min_value, max_value, num_buckets)`."""
        return (self.min_value, self.max_value, self.num_buckets)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableSpec(_TableSpec):
    """`embedding.TableSpec` with the reference's keywords.

    Attributes:
      quantization_config: compared and hashed; a table that has one is
        refused when placed in a stack.
      _setting_in_stack: init only, the reference's name of `setting_in_stack`.
      _stacked_table_spec: init only, the reference's name of
        `stacked_table_spec`.

    Raises:
      ValueError: a quantized table placed in a stack.
    """

    quantization_config: QuantizationConfig | None = None
    _setting_in_stack: dataclasses.InitVar[TableSettingInStack | None] = None
    _stacked_table_spec: dataclasses.InitVar[StackedTableSpec | None] = None

    def __post_init__(
        self,
        _setting_in_stack: TableSettingInStack | None,
        _stacked_table_spec: StackedTableSpec | None,
    ) -> None:
        if _setting_in_stack is not None:
            object.__setattr__(self, "setting_in_stack", _setting_in_stack)
        if _stacked_table_spec is not None:
            object.__setattr__(self, "stacked_table_spec", _stacked_table_spec)
        super().__post_init__()
        if self.quantization_config is not None and self.is_stacked():
            raise ValueError(
                f"TableSpec {self.name!r}: quantized tables (quantization_config="
                f"{self.quantization_config}) are not supported; sparseflow keeps tables in "
                "float32. Build the table without quantization_config."
            )
