"""The config's `tables` and `stacks` sections."""

from __future__ import annotations

from collections.abc import Mapping

import embedding
from embedding import initializers
from sparseflow.config._checker import (
    Node,
    build,
    check_kind,
    choice,
    enum_values,
    get,
    integer,
    mapping,
    named_list,
    typed_spec,
)
from sparseflow.config._mesh import MeshConfig

_OPTIMIZERS: dict[str, type[embedding.OptimizerSpec]] = {
    spec.config_type: spec
    for spec in (
        embedding.SGDOptimizerSpec,
        embedding.AdagradOptimizerSpec,
        embedding.RowWiseAdagradOptimizerSpec,
        embedding.AdamOptimizerSpec,
        embedding.FTRLOptimizerSpec,
        embedding.LaPropOptimizerSpec,
        embedding.AdagradMomentumOptimizerSpec,
        embedding.F2AOptimizerSpec,
        embedding.RowWiseAdamOptimizerSpec,
    )
}
_INITIALIZERS: dict[str, type] = {
    "normal": initializers.Normal,
    "truncated_normal": initializers.TruncatedNormal,
    "uniform": initializers.Uniform,
    "constant": initializers.Constant,
}


def _table(node: Node) -> embedding.TableSpec:
    mapping(
        node,
        (
            "name",
            "vocabulary_size",
            "embedding_dim",
            "combiner",
            "optimizer",
            "initializer",
            "max_ids_per_partition",
            "max_unique_ids_per_partition",
        ),
        ("suggested_coo_buffer_size_per_device",),
    )
    return build(
        node,
        embedding.TableSpec,
        dict(
            name=get(node, "name", "str"),
            vocabulary_size=integer(node, "vocabulary_size"),
            embedding_dim=integer(node, "embedding_dim"),
            combiner=choice(node, "combiner", enum_values(embedding.Combiner), "combiner"),
            optimizer=typed_spec(node.child("optimizer"), _OPTIMIZERS, "optimizer"),
            initializer=typed_spec(node.child("initializer"), _INITIALIZERS, "initializer"),
            max_ids_per_partition=integer(node, "max_ids_per_partition"),
            max_unique_ids_per_partition=integer(node, "max_unique_ids_per_partition"),
            suggested_coo_buffer_size_per_device=integer(
                node, "suggested_coo_buffer_size_per_device"
            ),
        ),
    )


def read_tables(node: Node) -> dict[str, embedding.TableSpec]:
    """The logical tables by name, in config order."""
    return named_list(node, "table", _table)


def check_tables_used(
    node: Node, tables: Mapping[str, embedding.TableSpec], used: set[str]
) -> None:
    """Rejects a table (at `node[i]`) that no feature reads."""
    for i, name in enumerate(tables):
        if name not in used:
            raise node.child(i).error(
                f"table {name!r} is read by no feature; remove it or add a feature"
            )


AUTO_STACKS = "auto"
NO_STACKS = "none"


def apply_stacks(
    node: Node | None,
    feature_specs: dict[str, embedding.FeatureSpec],
    tables: Mapping[str, embedding.TableSpec],
    mesh: MeshConfig,
) -> dict[str, embedding.FeatureSpec]:
    """Applies the `stacks` section to `feature_specs`.

    `stacks: auto` (also when the section is absent) stacks every group of
    tables that can share a stack (`embedding.auto_stack_tables`); `stacks:
    none` stacks nothing; a list of table-name lists makes exactly those
    stacks.
    """
    choice = AUTO_STACKS if node is None else node.value
    if isinstance(choice, str):
        if choice == AUTO_STACKS:
            return embedding.auto_stack_tables(
                feature_specs, mesh.devices, mesh.partitions_per_device
            )
        if choice == NO_STACKS:
            return feature_specs
        raise node.error(
            f"expected {AUTO_STACKS!r}, {NO_STACKS!r} or a list of stacks (lists of table "
            f"names), got {choice!r}"
        )
    order = list(feature_specs)
    stacked_in: dict[str, int] = {}
    for i, names in enumerate(check_kind(node, "list")):
        stack = node.child(i)
        if len(check_kind(stack, "list")) < 2:
            raise stack.error(f"a stack needs at least two tables, got {names!r}")
        for j in range(len(names)):
            name = check_kind(stack.child(j), "str")
            if name not in tables:
                raise stack.child(j).error(
                    f"unknown table {name!r}; known tables: {', '.join(tables)}"
                )
            if name in stacked_in:
                raise stack.child(j).error(
                    f"table {name!r} is already in {node.path}[{stacked_in[name]}]"
                )
            stacked_in[name] = i
        try:
            feature_specs = embedding.stack_tables(
                feature_specs, names, mesh.devices, mesh.partitions_per_device
            )
        except ValueError as e:
            raise stack.error(str(e)) from e
    # The stacking returns the dict in sorted-key order; keep the config's.
    return {name: feature_specs[name] for name in order}
