"""The config's `record` section: the keys and types of the training records.

Without it, records follow the fixed layout the synthetic writer produces
(`pipelines.FeatureLayout`). With it, each feature may name its record key
(default: the feature's name), the type of its ids (`int64`, or `bytes`
hashed into its table's vocabulary), a weights key, and whether a record
must hold it; `dense` lists the dense keys, `label` the label's key and type:

  record:
    features:
      user_id: {key: uid, ids: bytes, weights: uid_weights, required: true}
    dense:
      - clicks                                  # one float, required
      - {key: age, type: int, default: 0, transform: log1p}
      - {key: embedding, length: 8, default: 0.0, transform: standardize}
    label: {key: clicked, type: float, threshold: 0.5}
"""

from __future__ import annotations

from collections.abc import Mapping

import embedding
import pipelines
from sparseflow.config._checker import (
    Node,
    build,
    check_kind,
    choice,
    enum_choice,
    enum_values,
    get,
    integer,
    mapping,
)

_SPARSE_KEYS = ("key", "ids", "weights", "required")
_DENSE_KEYS = ("key", "length", "type", "default", "transform")
_LABEL_KEYS = ("key", "type", "threshold")


def _sparse(node: Node, name: str, table: embedding.TableSpec) -> pipelines.SparseColumn:
    mapping(node, (), _SPARSE_KEYS)
    ids = enum_choice(node, "ids", pipelines.IdType.INT64, "id type")
    return build(
        node,
        pipelines.SparseColumn,
        dict(
            name=name,
            key=get(node, "key", "str", name),
            ids=ids,
            hash_buckets=table.vocabulary_size if ids is pipelines.IdType.BYTES else None,
            weights_key=get(node, "weights", "str"),
            required=get(node, "required", "bool", False),
        ),
    )


def _sparse_columns(
    node: Node | None, features: Mapping[str, embedding.FeatureSpec]
) -> tuple[pipelines.SparseColumn, ...]:
    """Per feature in config order: its entry under `node` (a mapping by name) or the default."""
    entries = {}
    if node is not None:
        mapping(node, (), tuple(features), what="feature")
        for name in node.value:
            entry = node.child(name)
            if entry.value is None:  # `name:` alone takes every default
                entry = Node({}, entry.source, entry.path)
            entries[name] = _sparse(entry, name, features[name].table_spec)
    return tuple(
        entries.get(name) or pipelines.SparseColumn(name=name, key=name) for name in features
    )


def _dense(node: Node) -> pipelines.DenseColumn:
    if isinstance(node.value, str):
        return build(node, pipelines.DenseColumn, dict(key=node.value))
    mapping(node, ("key",), _DENSE_KEYS[1:])
    kwargs = dict(key=get(node, "key", "str"), length=integer(node, "length", 1))
    if "type" in node.value:
        kwargs["type"] = choice(node, "type", enum_values(pipelines.ValueType), "value type")
    if "transform" in node.value:
        kwargs["transform"] = choice(
            node, "transform", enum_values(pipelines.DenseTransform), "dense transform"
        )
    kwargs["default"] = get(node, "default", "number")
    return build(node, pipelines.DenseColumn, kwargs)


def _label(node: Node) -> pipelines.LabelColumn:
    mapping(node, (), _LABEL_KEYS)
    kwargs = {"key": get(node, "key", "str", pipelines.LabelColumn.key)}
    if "type" in node.value:
        kwargs["type"] = choice(node, "type", enum_values(pipelines.ValueType), "label type")
    if "threshold" in node.value:
        if kwargs.get("type") != pipelines.ValueType.FLOAT.value:
            raise node.child("threshold").error("a threshold applies to a float label only")
        kwargs["threshold"] = get(node, "threshold", "number")
    return build(node, pipelines.LabelColumn, kwargs)


def read_record(
    node: Node, features: Mapping[str, embedding.FeatureSpec]
) -> pipelines.FeatureLayout:
    """The layout of a config with a `record` section at `node`."""
    mapping(node, (), ("features", "dense", "label"))
    sparse = _sparse_columns(node.child("features") if node.has("features") else None, features)
    dense = ()
    if node.has("dense"):
        dense_node = node.child("dense")
        dense = tuple(
            _dense(dense_node.child(i)) for i in range(len(check_kind(dense_node, "list")))
        )
    label = _label(node.child("label")) if node.has("label") else pipelines.LabelColumn()
    schema = build(node, pipelines.RecordSchema, dict(sparse=sparse, dense=dense, label=label))
    return pipelines.FeatureLayout.from_schema(schema)
