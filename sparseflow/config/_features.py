"""The config's `features` section: which table each feature reads."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import embedding
from sparseflow.config._checker import Node, build, get, mapping, named_list


@dataclasses.dataclass(frozen=True)
class Feature:
    """One feature entry: its embedding spec, and whether the fixed layout weights it."""

    name: str
    spec: embedding.FeatureSpec
    weighted: bool


def _feature(
    node: Node, tables: Mapping[str, embedding.TableSpec], global_batch_size: int
) -> Feature:
    mapping(node, ("name", "table"), ("weighted",))
    name = get(node, "name", "str")
    table_name = get(node, "table", "str")
    if table_name not in tables:
        raise node.child("table").error(
            f"unknown table {table_name!r}; known tables: {', '.join(tables)}"
        )
    table = tables[table_name]
    spec = build(
        node,
        embedding.FeatureSpec,
        dict(
            name=name,
            table_spec=table,
            # Ragged: how many ids a sample holds is the data's matter.
            input_shape=[global_batch_size],
            output_shape=[global_batch_size, table.embedding_dim],
        ),
    )
    return Feature(name, spec, get(node, "weighted", "bool", False))


def read_features(
    node: Node, tables: Mapping[str, embedding.TableSpec], global_batch_size: int
) -> dict[str, Feature]:
    """The features by name, in config order."""
    return named_list(node, "feature", lambda entry: _feature(entry, tables, global_batch_size))
