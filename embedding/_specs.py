"""Table and feature specs (docs/design.md section 1).

`TableSpec` and `FeatureSpec` accept the keywords of jax-tpu-embedding's
classes of the same names. Unlike those, they are frozen: the stacking
functions (`prepare_feature_specs_for_training`, `stack_tables`) return new
specs with the stacking fields filled in instead of editing them in place,
and the preprocessing prepares unprepared specs itself, so code that ignores
the return value (as jax-tpu-embedding code does) still gets the right layout.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from embedding._optimizers import OptimizerSpec
from embedding.checks import check_positive_int

TableInitializer = Callable[..., Any]
"""`init(key, shape, dtype) -> array`, as `jax.nn.initializers`."""

DEFAULT_LIMIT = 256


class Combiner(str, enum.Enum):
    """How the ids of one sample are reduced into one activation."""

    SUM = "sum"
    MEAN = "mean"
    SQRTN = "sqrtn"


def _combiner(value: str | Combiner, owner: str) -> Combiner:
    try:
        return Combiner(value)
    except ValueError:
        choices = ", ".join(c.value for c in Combiner)
        raise ValueError(f"{owner}: combiner must be one of {choices}; got {value!r}.") from None


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= `value`."""
    return -(-value // multiple) * multiple


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableSettingInStack:
    """Where a table sits inside its stacked (physical) table.

    Attributes:
      stack_name: the physical table (its own name when not stacked).
      padded_vocab_size: vocabulary padded to a multiple of `8 * N`.
      padded_embedding_dim: dim padded to a multiple of 8 (the stack's max).
      row_offset_in_shard: first row of this table inside every partition shard.
      shard_rotation: id `i` lives in partition `(i + shard_rotation) mod N`.
    """

    stack_name: str
    padded_vocab_size: int
    padded_embedding_dim: int
    row_offset_in_shard: int = 0
    shard_rotation: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class StackedTableSpec:
    """One physical table: one or more logical tables stacked row-wise.

    Attributes:
      stack_name: name of the physical table; keys of the preprocessed input.
      stack_vocab_size: sum of the padded vocabularies of its tables.
      stack_embedding_dim: the common padded dim.
      optimizer: shared by every table of the stack.
      combiner: shared by every table of the stack.
      total_sample_count: global samples per batch over all features using it.
      max_ids_per_partition: limit on entries per (slot, partition) per batch.
      max_unique_ids_per_partition: limit on distinct ids per (slot, partition).
      suggested_coo_buffer_size_per_device: buffer entries per device (FDO),
        or None for the theoretical maximum.
    """

    stack_name: str
    stack_vocab_size: int
    stack_embedding_dim: int
    optimizer: OptimizerSpec
    combiner: Combiner
    total_sample_count: int
    max_ids_per_partition: int = DEFAULT_LIMIT
    max_unique_ids_per_partition: int = DEFAULT_LIMIT
    suggested_coo_buffer_size_per_device: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableSpec:
    """One logical embedding table.

    Attributes:
      name: unique table name.
      vocabulary_size: number of rows; ids must lie in [0, vocabulary_size).
      embedding_dim: width of a row.
      initializer: `init(key, shape, dtype)`; see `embedding.initializers`.
      optimizer: an `OptimizerSpec` (`embedding/_optimizers.py`).
      combiner: "sum", "mean" or "sqrtn".
      max_ids_per_partition: limit on entries per partition slot per batch.
      max_unique_ids_per_partition: limit on distinct ids per partition slot.
      suggested_coo_buffer_size_per_device: FDO buffer size, or None.
      stacked_table_spec: filled in by the stacking functions.
      setting_in_stack: filled in by the stacking functions.
    """

    name: str
    vocabulary_size: int
    embedding_dim: int
    initializer: TableInitializer
    optimizer: OptimizerSpec
    combiner: Combiner | str
    max_ids_per_partition: int = DEFAULT_LIMIT
    max_unique_ids_per_partition: int = DEFAULT_LIMIT
    suggested_coo_buffer_size_per_device: int | None = None
    stacked_table_spec: StackedTableSpec | None = None
    setting_in_stack: TableSettingInStack | None = None

    def __post_init__(self) -> None:
        owner = f"TableSpec {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TableSpec: name must be a non-empty string, got {self.name!r}.")
        object.__setattr__(self, "combiner", _combiner(self.combiner, owner))
        check_positive_int(self.vocabulary_size, f"{owner}: vocabulary_size")
        check_positive_int(self.embedding_dim, f"{owner}: embedding_dim")
        check_positive_int(self.max_ids_per_partition, f"{owner}: max_ids_per_partition")
        check_positive_int(
            self.max_unique_ids_per_partition, f"{owner}: max_unique_ids_per_partition"
        )
        if self.suggested_coo_buffer_size_per_device is not None:
            check_positive_int(
                self.suggested_coo_buffer_size_per_device,
                f"{owner}: suggested_coo_buffer_size_per_device",
            )
        if not isinstance(self.optimizer, OptimizerSpec):
            raise TypeError(
                f"{owner}: optimizer must be an OptimizerSpec (e.g. "
                f"embedding.AdagradOptimizerSpec()), got {type(self.optimizer).__name__}."
            )
        if not callable(self.initializer):
            raise TypeError(f"{owner}: initializer must be callable (key, shape, dtype).")

    def is_stacked(self) -> bool:
        """True once a stacking function has placed this table in a stack."""
        return self.stacked_table_spec is not None


def limits_of(spec: TableSpec | StackedTableSpec) -> dict[str, int | None]:
    """The limits of `spec`, as keywords of either spec: a table and its stack carry the same."""
    return dict(
        max_ids_per_partition=spec.max_ids_per_partition,
        max_unique_ids_per_partition=spec.max_unique_ids_per_partition,
        suggested_coo_buffer_size_per_device=spec.suggested_coo_buffer_size_per_device,
    )


@dataclasses.dataclass(frozen=True)
class FeatureIdTransformation:
    """How a feature's ids and samples map into its stacked table.

    Attributes:
      row_offset: global samples of earlier features in the same stack.
      col_offset: `row_offset_in_shard * N` of the feature's table.
      col_shift: the table's shard rotation.
    """

    row_offset: int = 0
    col_offset: int = 0
    col_shift: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureSpec:
    """One input feature looked up in one table.

    Attributes:
      name: unique feature name.
      table_spec: the table it reads.
      input_shape: `[global_batch, valency]` (valency may be omitted: ragged).
      output_shape: `[global_batch, embedding_dim]`.
      id_transformation: filled in by the stacking functions.
    """

    name: str
    table_spec: TableSpec
    input_shape: Sequence[int]
    output_shape: Sequence[int]
    id_transformation: FeatureIdTransformation | None = None

    def __post_init__(self) -> None:
        owner = f"FeatureSpec {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"FeatureSpec: name must be a non-empty string, got {self.name!r}.")
        if not isinstance(self.table_spec, TableSpec):
            raise TypeError(f"{owner}: table_spec must be a TableSpec.")
        object.__setattr__(self, "input_shape", tuple(int(d) for d in self.input_shape))
        object.__setattr__(self, "output_shape", tuple(int(d) for d in self.output_shape))
        if not 1 <= len(self.input_shape) <= 2:
            raise ValueError(
                f"{owner}: input_shape must be [global_batch] or [global_batch, "
                f"valency], got {list(self.input_shape)}."
            )
        if len(self.output_shape) != 2:
            raise ValueError(
                f"{owner}: output_shape must be [global_batch, embedding_dim], got "
                f"{list(self.output_shape)}."
            )
        if self.input_shape[0] != self.output_shape[0]:
            raise ValueError(
                f"{owner}: input_shape batch {self.input_shape[0]} differs from "
                f"output_shape batch {self.output_shape[0]}."
            )
        check_positive_int(self.input_shape[0], f"{owner}: global batch (input_shape[0])")
        if self.output_shape[1] != self.table_spec.embedding_dim:
            raise ValueError(
                f"{owner}: output_shape[1] = {self.output_shape[1]} must equal the "
                f"embedding_dim {self.table_spec.embedding_dim} of table "
                f"{self.table_spec.name!r}."
            )

    @property
    def global_batch_size(self) -> int:
        return self.input_shape[0]


def feature_dims(feature_specs: Mapping[str, FeatureSpec]) -> dict[str, int]:
    """The width of each feature's activations (its table's `embedding_dim`), by name,
    in the order of `feature_specs`."""
    return {name: spec.table_spec.embedding_dim for name, spec in feature_specs.items()}
