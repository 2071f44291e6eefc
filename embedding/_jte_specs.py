"""jax-tpu-embedding's `TableSpec` and `QuantizationConfig`, for `jte_compat`.

The reference builds a table already placed in a stack with
`TableSpec(..., _setting_in_stack=..., _stacked_table_spec=...)`, describes
quantized tables with `quantization_config=`, and edits a table in place
(`table.stacked_table_spec = dataclasses.replace(...)`). Here `TableSpec` is
`embedding.TableSpec` with those keywords and those assignments; a
quantized table compares and hashes by its config but is refused once it is
placed in a stack (every lookup, update and layout places it), since
sparseflow keeps every table in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from embedding._specs import FeatureSpec, StackedTableSpec, TableSettingInStack, limits_of
from embedding._specs import TableSpec as _TableSpec
from embedding._stacking import Nested

# Assignable once the table is in a stack (the reference's own rule).
_STACKING_FIELDS = ("stacked_table_spec", "setting_in_stack")
_FDO_FIELDS = (
    "max_ids_per_partition",
    "max_unique_ids_per_partition",
    "suggested_coo_buffer_size_per_device",
)


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
    """`embedding.TableSpec` with the reference's keywords and in-place edits.

    The reference's `TableSpec` is a mutable dataclass: its code and its
    users assign `table.stacked_table_spec = ...` (e.g. a buffer size on the
    stack) and, before stacking, any field. A switching script keeps doing
    so here, under the reference's rules: the stacking fields always, the
    others only while the table is in no stack. Each assignment is checked
    as the constructor checks (a bad value raises and leaves the table as it
    was). `embedding`'s own specs stay frozen: only this class, which only
    `jte_compat` hands out, can change, and every function reads the value
    a table has when it is called. As in the reference (`unsafe_hash`), the
    hash follows the fields: do not edit a table while it is a key of a dict
    or a static argument of a compiled function.

    Attributes:
      quantization_config: compared and hashed; a table that has one is
        refused when placed in a stack.
      _setting_in_stack: init only, the reference's name of `setting_in_stack`.
      _stacked_table_spec: init only, the reference's name of
        `stacked_table_spec`.

    Raises:
      ValueError: a quantized table placed in a stack.
      AttributeError: assigning a field other than `stacked_table_spec` or
        `setting_in_stack` once the table is in a stack.
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


def _assign(self: TableSpec, name: str, value: Any) -> None:
    """The reference's in-place edit, checked by building the edited table."""
    if name not in {f.name for f in dataclasses.fields(self)}:
        raise AttributeError(f"TableSpec has no field {name!r}.")
    if self.is_stacked() and name not in _STACKING_FIELDS:
        fix = (
            "use update_preprocessing_parameters() to update the StackedTableSpec"
            if name in _FDO_FIELDS
            else "build a new TableSpec with dataclasses.replace(table_spec, ...) and "
            "prepare the feature specs again"
        )
        raise AttributeError(
            f"Cannot update {name!r} on TableSpec {self.name!r} after it has been stacked; {fix}."
        )
    edited = dataclasses.replace(self, **{name: value})
    object.__setattr__(self, name, getattr(edited, name))


# A frozen dataclass may not define __setattr__ in its body.
TableSpec.__setattr__ = _assign


def _unplaced(table: _TableSpec, stack: StackedTableSpec) -> _TableSpec:
    return dataclasses.replace(
        table, **limits_of(stack), stacked_table_spec=None, setting_in_stack=None
    )


def read_placements(feature_specs: Nested) -> Nested:
    """Features whose table was placed in a stack by hand, read as the reference reads them.

    The reference counts a feature as prepared once its table has a
    `stacked_table_spec`, with no id transformation (offset and rotation 0)
    if the feature has none; its layout then follows the stack's limits and
    buffer size, never its padding. A table alone in a stack of its name is
    read here as that table with the stack's limits and buffer, unplaced, so
    that it is placed (padded) for the geometry at hand like any unprepared
    table, and lays out as in the reference.

    Args:
      feature_specs: pytree of `FeatureSpec`.

    Returns:
      The same pytree; only features placed by hand without a transformation
      differ.

    Raises:
      ValueError: such a feature's table shares its stack, or is offset or
        rotated in it (its ids need the transformation that stacking gives).
    """

    def read(feature: FeatureSpec) -> FeatureSpec:
        table = feature.table_spec
        if feature.id_transformation is not None or not table.is_stacked():
            return feature
        stack, setting = table.stacked_table_spec, table.setting_in_stack
        alone = stack.stack_name == table.name and (
            setting is None
            or (setting.stack_name, setting.row_offset_in_shard, setting.shard_rotation)
            == (table.name, 0, 0)
        )
        if not alone:
            raise ValueError(
                f"Feature {feature.name!r}: table {table.name!r} is placed in stack "
                f"{stack.stack_name!r} (row offset, rotation) but the feature has no "
                "id_transformation; stack the tables with prepare_feature_specs_for_training "
                "or stack_tables so that the feature gets one."
            )
        return dataclasses.replace(feature, table_spec=_unplaced(table, stack))

    return jax.tree.map(read, feature_specs)
