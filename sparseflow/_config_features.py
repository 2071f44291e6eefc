"""The config's `features` section: which table each feature reads."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import embedding
import pipelines
from sparseflow._config_checker import Node, build, check_kind, get, mapping, named_list

_DEFAULT_ZIPF_EXPONENT = 1.1


@dataclasses.dataclass(frozen=True)
class Feature:
    """One feature entry: its embedding spec and its synthetic description."""

    name: str
    spec: embedding.FeatureSpec
    synthetic: pipelines.SyntheticFeature


def _valency(node: Node) -> tuple[int, int]:
    values = check_kind(node, "list")
    if len(values) != 2:
        raise node.error(f"expected [min, max], got {values!r}")
    low, high = (check_kind(node.child(i), "int") for i in range(2))
    if low < 1:
        raise node.error(f"min valency must be >= 1 (every sample has an id), got {low}")
    if low > high:
        raise node.error(f"min valency {low} is greater than max valency {high}")
    return low, high


def _feature(
    node: Node, tables: Mapping[str, embedding.TableSpec], global_batch_size: int
) -> Feature:
    mapping(node, ("name", "table", "valency"), ("zipf", "weighted"))
    name = get(node, "name", "str")
    table_name = get(node, "table", "str")
    if table_name not in tables:
        raise node.child("table").error(
            f"unknown table {table_name!r}; known tables: {', '.join(tables)}"
        )
    table = tables[table_name]
    min_valency, max_valency = _valency(node.child("valency"))
    zipf = get(node, "zipf", "number", _DEFAULT_ZIPF_EXPONENT)
    if not zipf > 1:
        raise node.child("zipf").error(f"the Zipf exponent must be > 1, got {zipf}")
    spec = build(
        node,
        embedding.FeatureSpec,
        dict(
            name=name,
            table_spec=table,
            input_shape=[global_batch_size, max_valency],
            output_shape=[global_batch_size, table.embedding_dim],
        ),
    )
    synthetic = build(
        node,
        pipelines.SyntheticFeature,
        dict(
            name=name,
            vocabulary_size=table.vocabulary_size,
            min_valency=min_valency,
            max_valency=max_valency,
            zipf_exponent=zipf,
            weighted=get(node, "weighted", "bool", False),
        ),
    )
    return Feature(name, spec, synthetic)


def read_features(
    node: Node, tables: Mapping[str, embedding.TableSpec], global_batch_size: int
) -> dict[str, Feature]:
    """The features by name, in config order."""
    return named_list(node, "feature", lambda entry: _feature(entry, tables, global_batch_size))
