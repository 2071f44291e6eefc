"""Feature stacking and table stacking (docs/design.md section 1).

Feature stacking: features that read the same table share one physical table;
their samples are concatenated (ordered by feature name), each feature offset
by the samples of the earlier ones. Table stacking: tables with the same
padded dim, optimizer and combiner are concatenated row-wise inside every
partition shard, each rotated by `rotation` partitions against the previous
one so that their hot ids (small ids, under Zipf) land on different
partitions.

Both functions return new specs with the same tree structure as their input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from embedding._specs import (
    FeatureIdTransformation,
    FeatureSpec,
    StackedTableSpec,
    TableSettingInStack,
    TableSpec,
    limits_of,
    round_up,
)
from embedding.checks import check_positive_int

Nested = Any
"""A pytree (dict, list, tuple, ...) whose leaves are `FeatureSpec`s."""


def check_partition_count(global_device_count: int, num_sc_per_device: int) -> int:
    """Returns `N = global_device_count * num_sc_per_device`, checked.

    Raises:
      ValueError: a count is not positive, or N is not a power of two (the
        layout selects partitions with `id & (N - 1)`).
    """
    for name, value in (
        ("global_device_count", global_device_count),
        ("num_sc_per_device", num_sc_per_device),
    ):
        check_positive_int(value, name)
    n = global_device_count * num_sc_per_device
    if n & (n - 1):
        raise ValueError(
            f"The number of partitions N = global_device_count ({global_device_count}) "
            f"x num_sc_per_device ({num_sc_per_device}) = {n} must be a power of two."
        )
    return n


def _leaves(feature_specs: Nested) -> list[FeatureSpec]:
    leaves = jax.tree.leaves(feature_specs)
    names = set()
    tables: dict[str, TableSpec] = {}
    for feature in leaves:
        if not isinstance(feature, FeatureSpec):
            raise TypeError(f"Expected FeatureSpec leaves, got {type(feature).__name__}.")
        if feature.name in names:
            raise ValueError(f"Two features are named {feature.name!r}; names must be unique.")
        names.add(feature.name)
        table = _unstacked(feature.table_spec)
        known = tables.setdefault(table.name, table)
        if known != table:
            raise ValueError(
                f"Two different tables are named {table.name!r} (feature {feature.name!r} "
                "disagrees with an earlier feature); table names must be unique."
            )
    return leaves


def _unstacked(table: TableSpec) -> TableSpec:
    return dataclasses.replace(table, stacked_table_spec=None, setting_in_stack=None)


def _samples(feature: FeatureSpec) -> int:
    return feature.global_batch_size


def _replace_leaves(feature_specs: Nested, new: dict[str, FeatureSpec]) -> Nested:
    return jax.tree.map(lambda f: new.get(f.name, f), feature_specs)


def _is_prepared(feature: FeatureSpec) -> bool:
    return feature.table_spec.is_stacked() and feature.id_transformation is not None


def own_stack(table: TableSpec, num_partitions: int, total_sample_count: int) -> TableSpec:
    """`table` alone in a stack of its name, padded for `num_partitions` partitions."""
    table = _unstacked(table)
    padded_vocab = round_up(table.vocabulary_size, 8 * num_partitions)
    padded_dim = round_up(table.embedding_dim, 8)
    setting = TableSettingInStack(
        stack_name=table.name,
        padded_vocab_size=padded_vocab,
        padded_embedding_dim=padded_dim,
    )
    stacked = StackedTableSpec(
        stack_name=table.name,
        stack_vocab_size=padded_vocab,
        stack_embedding_dim=padded_dim,
        optimizer=table.optimizer,
        combiner=table.combiner,
        total_sample_count=total_sample_count,
        **limits_of(table),
    )
    return dataclasses.replace(table, stacked_table_spec=stacked, setting_in_stack=setting)


def prepare_feature_specs_for_training(
    feature_specs: Nested, global_device_count: int, num_sc_per_device: int
) -> Nested:
    """Gives every table not yet in a stack a stack of its own.

    Features sharing a table are feature-stacked, ordered by feature name.
    Already stacked features (from `stack_tables`) are kept as they are.

    Args:
      feature_specs: a pytree of `FeatureSpec`.
      global_device_count: devices over all hosts, typically `mesh.size`.
      num_sc_per_device: partitions ("sparse cores") per device.

    Returns:
      The same pytree with prepared `FeatureSpec`s.
    """
    n = check_partition_count(global_device_count, num_sc_per_device)
    by_table: dict[str, list[FeatureSpec]] = {}
    for feature in _leaves(feature_specs):
        if not _is_prepared(feature):
            by_table.setdefault(feature.table_spec.name, []).append(feature)
    new: dict[str, FeatureSpec] = {}
    for features in by_table.values():
        features = sorted(features, key=lambda f: f.name)
        table = own_stack(features[0].table_spec, n, sum(_samples(f) for f in features))
        row_offset = 0
        for feature in features:
            new[feature.name] = dataclasses.replace(
                feature,
                table_spec=table,
                id_transformation=FeatureIdTransformation(row_offset=row_offset),
            )
            row_offset += _samples(feature)
    return _replace_leaves(feature_specs, new)


def _check_stackable(tables: Sequence[TableSpec], stack_name: str) -> int:
    dims = {round_up(t.embedding_dim, 8) for t in tables}
    for what, values in (
        ("padded embedding dim", dims),
        ("optimizer", {t.optimizer for t in tables}),
        ("combiner", {t.combiner for t in tables}),
    ):
        if len(values) > 1:
            raise ValueError(
                f"Cannot stack tables {[t.name for t in tables]} into {stack_name!r}: "
                f"their {what} differs ({sorted(map(str, values))}). Stack only tables "
                "with the same padded dim, optimizer and combiner."
            )
    return dims.pop()


def _summed_limit(tables: Sequence[TableSpec], field: str) -> int | None:
    # A stack's partition holds ids of all its tables, so each table keeps its
    # own budget: the stack's limit is the sum of the tables' limits.
    values = [getattr(t, field) for t in tables]
    return None if any(v is None for v in values) else sum(values)


def stack_tables(
    feature_specs: Nested,
    table_names: Sequence[str],
    global_device_count: int,
    num_sc_per_device: int,
    *,
    rotation: int | None = None,
    stack_name: str | None = None,
) -> Nested:
    """Stacks the named tables into one physical table.

    Args:
      feature_specs: a pytree of `FeatureSpec`.
      table_names: tables to stack, in stacking order (at least one).
      global_device_count: devices over all hosts, typically `mesh.size`.
      num_sc_per_device: partitions per device.
      rotation: partitions by which each table is rotated against the previous
        one; defaults to `num_sc_per_device`.
      stack_name: name of the physical table; defaults to the table names
        joined by "_".

    Returns:
      The same pytree, with the features of these tables stacked.

    Raises:
      ValueError: an unknown or already stacked table, or tables that differ in
        padded dim, optimizer or combiner.
    """
    n = check_partition_count(global_device_count, num_sc_per_device)
    leaves = _leaves(feature_specs)
    known = {f.table_spec.name: f.table_spec for f in leaves}
    if not table_names:
        raise ValueError("stack_tables: table_names is empty.")
    if len(set(table_names)) != len(table_names):
        raise ValueError(f"stack_tables: a table is named twice in {list(table_names)}.")
    for name in table_names:
        if name not in known:
            raise ValueError(
                f"stack_tables: unknown table {name!r}; tables used by the features: "
                f"{sorted(known)}."
            )
        if known[name].is_stacked():
            raise ValueError(f"stack_tables: table {name!r} is already in a stack.")
    stack_name = stack_name or "_".join(table_names)
    tables = [known[name] for name in table_names]
    padded_dim = _check_stackable(tables, stack_name)
    rotation = num_sc_per_device if rotation is None else rotation

    settings: dict[str, TableSettingInStack] = {}
    row_offset_in_shard, shard_rotation = 0, 0
    for table in tables:
        padded_vocab = round_up(table.vocabulary_size, 8 * n)
        settings[table.name] = TableSettingInStack(
            stack_name=stack_name,
            padded_vocab_size=padded_vocab,
            padded_embedding_dim=padded_dim,
            row_offset_in_shard=row_offset_in_shard,
            shard_rotation=shard_rotation,
        )
        row_offset_in_shard += padded_vocab // n
        shard_rotation = (shard_rotation + rotation) % n

    features = [f for f in leaves if f.table_spec.name in settings]
    stacked = StackedTableSpec(
        stack_name=stack_name,
        stack_vocab_size=row_offset_in_shard * n,
        stack_embedding_dim=padded_dim,
        optimizer=tables[0].optimizer,
        combiner=tables[0].combiner,
        total_sample_count=sum(_samples(f) for f in features),
        max_ids_per_partition=_summed_limit(tables, "max_ids_per_partition"),
        max_unique_ids_per_partition=_summed_limit(tables, "max_unique_ids_per_partition"),
        suggested_coo_buffer_size_per_device=_summed_limit(
            tables, "suggested_coo_buffer_size_per_device"
        ),
    )
    new: dict[str, FeatureSpec] = {}
    row_offset = 0
    for feature in features:
        setting = settings[feature.table_spec.name]
        table = dataclasses.replace(
            feature.table_spec, stacked_table_spec=stacked, setting_in_stack=setting
        )
        new[feature.name] = dataclasses.replace(
            feature,
            table_spec=table,
            id_transformation=FeatureIdTransformation(
                row_offset=row_offset,
                col_offset=setting.row_offset_in_shard * n,
                col_shift=setting.shard_rotation,
            ),
        )
        row_offset += _samples(feature)
    return _replace_leaves(feature_specs, new)


# Longer joined names become short ones: a stack's name names its checkpoint
# items and FDO entries, and a file name has at most 255 bytes.
_MAX_JOINED_NAME = 100


def auto_stack_tables(
    feature_specs: Nested, global_device_count: int, num_sc_per_device: int
) -> Nested:
    """Stacks every group of unstacked tables that can share a stack.

    Tables with the same padded dim, optimizer (learning rate included) and
    combiner go into one stack, in the order `jax.tree.leaves` gives their
    first features (a dict's features in name order):
    one lookup, one update and one exchange per group instead of one per
    table. A group's stack is named by its tables' names joined by "_", or
    `<first>_to_<last>_<count>_tables` where that would exceed 100
    characters. A table alone in its group, and tables already stacked, are
    left as they are. Each table keeps its own rows and initializer, so a
    step gives the same values stacked or not, up to the order of float sums.

    Args:
      feature_specs: a pytree of `FeatureSpec`.
      global_device_count: devices over all hosts, typically `mesh.size`.
      num_sc_per_device: partitions per device.

    Returns:
      The same pytree with the groups stacked.
    """
    check_partition_count(global_device_count, num_sc_per_device)
    groups: dict[tuple, list[str]] = {}
    for feature in _leaves(feature_specs):
        table = feature.table_spec
        if table.is_stacked():
            continue
        key = (round_up(table.embedding_dim, 8), table.optimizer, table.combiner)
        names = groups.setdefault(key, [])
        if table.name not in names:
            names.append(table.name)
    for names in groups.values():
        if len(names) < 2:
            continue
        joined = "_".join(names)
        if len(joined) > _MAX_JOINED_NAME:
            joined = f"{names[0]}_to_{names[-1]}_{len(names)}_tables"
        feature_specs = stack_tables(
            feature_specs, names, global_device_count, num_sc_per_device, stack_name=joined
        )
    return feature_specs


def get_stacked_table_specs(feature_specs: Nested) -> dict[str, StackedTableSpec]:
    """The physical tables of prepared specs, by stack name (in first-use order).

    Raises:
      ValueError: a feature is not prepared (call
        `prepare_feature_specs_for_training` first).
    """
    stacks: dict[str, StackedTableSpec] = {}
    for feature in jax.tree.leaves(feature_specs):
        if not _is_prepared(feature):
            raise ValueError(
                f"Feature {feature.name!r} is not prepared; call "
                "embedding.prepare_feature_specs_for_training first."
            )
        stacked = feature.table_spec.stacked_table_spec
        stacks.setdefault(stacked.stack_name, stacked)
    return stacks
