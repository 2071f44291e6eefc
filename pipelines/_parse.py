"""Serialized `tf.train.Example` records <-> ragged id batches.

What a record holds is a `RecordSchema` (`_schema.py`). Without one, a
`FeatureLayout` reads the fixed layout that the synthetic writer produces:

  `<feature>`          int64 list: the sample's ids (may be empty, must be present).
  `<feature>_weights`  float list: one weight per id, for weighted features only.
  `dense`              float list of exactly `num_dense_features` values
                       (only read when `num_dense_features > 0`).
  `label`              int64 list holding exactly one value, 0 or 1.

`parse_examples` parses a whole batch in one compiled pass over the wire
format (`_example_wire.py`), or, for records that pass does not vouch for,
with one `tf.io.parse_example` call; both give every key's values and row
splits, which the same numpy code checks and turns into ids, dense values
and labels, so the two paths agree bit for bit. Only when the checks fail
are the records judged one by one, so a clean batch pays nothing for the
per-record diagnosis, and a bad record is named (index within the batch, and
why) instead of failing the batch with TF's message.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from google.protobuf import message as protobuf_message

from embedding import RaggedIds
from embedding.checks import check_int
from pipelines._dense_input import DenseKeys
from pipelines._errors import DataError
from pipelines._example_wire import (
    BYTES_LIST,
    FLOAT_LIST,
    INT64_LIST,
    WireSchema,
    read_examples,
)
from pipelines._record_batch import RecordBatch
from pipelines._records import tf_error_reason
from pipelines._schema import (
    DENSE_KEY,
    LABEL_KEY,
    DenseColumn,
    IdType,
    RecordSchema,
    ValueType,
    weights_key,
)
from pipelines._tensorflow import tf

_INT64 = "int64_list"
_FLOAT = "float_list"
_BYTES = "bytes_list"
_LIST_NAMES = {ValueType.INT: _INT64, ValueType.FLOAT: _FLOAT}


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureLayout:
    """What a record holds, i.e. what `parse_examples` reads from it.

    Give either the fixed layout's `sparse`, `weighted` and
    `num_dense_features`, or a `schema` (`FeatureLayout.from_schema`), from
    which they are then derived.

    Attributes:
      sparse: the sparse feature names, in output order.
      weighted: the sparse features that also carry weights.
      num_dense_features: width of the dense input (0: none read).
      schema: the record keys and types read; None on input: the fixed layout.
    """

    sparse: tuple[str, ...] = ()
    weighted: frozenset[str] = frozenset()
    num_dense_features: int = 0
    schema: RecordSchema | None = None

    def __post_init__(self):
        if self.schema is not None:
            if self.sparse or self.weighted or self.num_dense_features:
                raise ValueError(
                    "give a FeatureLayout either a schema or sparse/weighted/"
                    "num_dense_features, not both"
                )
            schema = self.schema
            object.__setattr__(self, "sparse", tuple(c.name for c in schema.sparse))
            object.__setattr__(
                self, "weighted", frozenset(c.name for c in schema.sparse if c.weights_key)
            )
            object.__setattr__(self, "num_dense_features", schema.num_dense_features)
            return
        if isinstance(self.sparse, str):
            raise TypeError(f"sparse must be a sequence of names, got the string {self.sparse!r}.")
        object.__setattr__(self, "sparse", tuple(self.sparse))
        object.__setattr__(self, "weighted", frozenset(self.weighted))
        if not self.sparse:
            raise ValueError("FeatureLayout needs at least one sparse feature.")
        for name in self.sparse:
            if not isinstance(name, str) or not name:
                raise ValueError(f"Sparse feature names must be non-empty strings, got {name!r}.")
        unknown = sorted(self.weighted - set(self.sparse))
        if unknown:
            raise ValueError(
                f"weighted names {unknown} are not sparse features {list(self.sparse)}; "
                "list every weighted feature in `sparse` as well."
            )
        check_int(self.num_dense_features, "num_dense_features", 0)
        weights = [weights_key(name) for name in self.sparse if name in self.weighted]
        keys = [*self.sparse, *weights, DENSE_KEY, LABEL_KEY]
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        if repeated:
            raise ValueError(
                f"Record keys {repeated} are used twice (keys: {keys}); rename the "
                f"features so that no name repeats or equals {DENSE_KEY!r}, "
                f"{LABEL_KEY!r} or another weighted feature's '<name>_weights'."
            )
        fixed = RecordSchema.fixed(self.sparse, self.weighted, self.num_dense_features)
        object.__setattr__(self, "schema", fixed)

    @classmethod
    def from_schema(cls, schema: RecordSchema) -> FeatureLayout:
        """The layout that reads records of `schema`."""
        return cls(schema=schema)

    def record_keys(self) -> list[str]:
        """Every key a record of this layout holds."""
        return self.schema.record_keys()


class ParsedBatch(NamedTuple):
    """A parsed batch of records (host numpy arrays).

    Attributes:
      ids: per sparse feature, `RaggedIds` with `int64[nnz]` values and
        `int64[batch + 1]` row splits.
      weights: per weighted feature, `RaggedIds` with `float32[nnz]` values and
        the same row splits as its ids; unweighted features are absent.
      dense: `float32[batch, num_dense_features]`, defaults filled in and
        transforms applied.
      labels: `int32[batch]`, each 0 or 1.
    """

    ids: dict[str, RaggedIds]
    weights: dict[str, RaggedIds]
    dense: np.ndarray
    labels: np.ndarray


class BadRecordError(DataError):
    """A record that does not match the `FeatureLayout`.

    Attributes:
      index: the record's position within the parsed batch.
      reason: what is wrong with it.
      others: how many more records of the batch are bad.
    """

    def __init__(self, index: int, reason: str, others: int = 0):
        more = f" ({others} more bad records in this batch)" if others else ""
        super().__init__(f"Bad record at index {index} of the batch: {reason}{more}")
        self.index = index
        self.reason = reason
        self.others = others

    def __reduce__(self):
        # Keeps the error intact across process boundaries (Grain workers).
        return BadRecordError, (self.index, self.reason, self.others)


class _BatchRejected(Exception):
    """The batch parse failed; the records must be judged one by one."""


def parse_examples(records: Sequence[bytes], layout: FeatureLayout) -> ParsedBatch:
    """Parses a batch of serialized `tf.train.Example` records.

    Args:
      records: `batch` serialized records (a list or a 1-D object array of bytes).
      layout: the features to read.

    Returns:
      The batch, in record order.

    Raises:
      BadRecordError: a record is not an Example, lacks a required key, holds
        the wrong value type or count, a non-finite dense value or label, an
        int label other than 0/1, or weights whose count differs from its
        ids'. Names the first bad record.
      ValueError: the layout standardizes a dense key without its moments.
    """
    _check_moments(layout.schema)
    records = _as_record_list(records)
    try:
        return _parse_batch(records, layout)
    except _BatchRejected:
        batch, problems = _separate(records, layout)
    if problems:
        index, reason = problems[0]
        raise BadRecordError(index, reason, others=len(problems) - 1)
    return batch


def parse_examples_lenient(
    records: Sequence[bytes], layout: FeatureLayout
) -> tuple[ParsedBatch, list[tuple[int, str]]]:
    """As `parse_examples`, but skips bad records instead of raising.

    Returns:
      The batch of the good records (in order), and `(index, reason)` for every
      skipped record, by increasing index.
    """
    _check_moments(layout.schema)
    records = _as_record_list(records)
    try:
        return _parse_batch(records, layout), []
    except _BatchRejected:
        return _separate(records, layout)


def serialize_examples(batch: ParsedBatch) -> list[bytes]:
    """The inverse of `parse_examples`: one serialized Example per sample.

    Map keys are written sorted, so the bytes depend on the values only.
    """
    sparse = [(name, _ragged_lists(ragged)) for name, ragged in batch.ids.items()]
    weights = [(weights_key(name), _ragged_lists(r)) for name, r in batch.weights.items()]
    dense = np.asarray(batch.dense, dtype=np.float32).tolist()
    labels = np.asarray(batch.labels).tolist()
    records = []
    for row, label in enumerate(labels):
        feature = {
            key: _int64_feature(values[splits[row] : splits[row + 1]])
            for key, (values, splits) in sparse
        }
        for key, (values, splits) in weights:
            feature[key] = _float_feature(values[splits[row] : splits[row + 1]])
        if dense[row]:
            feature[DENSE_KEY] = _float_feature(dense[row])
        feature[LABEL_KEY] = _int64_feature([label])
        example = tf.train.Example(features=tf.train.Features(feature=feature))
        records.append(example.SerializeToString(deterministic=True))
    return records


def _ragged_lists(ragged: RaggedIds) -> tuple[list, list[int]]:
    # Python lists slice far faster than numpy arrays convert, one row at a time.
    return np.asarray(ragged.values).tolist(), np.asarray(ragged.row_splits).tolist()


def _int64_feature(values: list[int]) -> tf.train.Feature:
    return tf.train.Feature(int64_list=tf.train.Int64List(value=values))


def _float_feature(values: list[float]) -> tf.train.Feature:
    return tf.train.Feature(float_list=tf.train.FloatList(value=values))


def _as_record_list(records: Sequence[bytes]) -> Sequence[bytes]:
    """`records` as a list of bytes, checked; a `RecordBatch` as it is (its
    records are bytes)."""
    if isinstance(records, RecordBatch):
        return records
    if isinstance(records, np.ndarray) and records.dtype.kind == "S":
        raise TypeError(
            f"The records arrived as a fixed-width bytes array (dtype {records.dtype}), "
            "which drops each record's trailing zero bytes; pass a list or an object "
            "array (with Grain, batch records with `batch(n, batch_fn=list)`)."
        )
    records = list(records)
    for index, record in enumerate(records):
        if not isinstance(record, bytes):
            raise TypeError(
                f"Records must be bytes (serialized tf.train.Example); record {index} "
                f"is a {type(record).__name__}."
            )
    return records


def _check_moments(schema: RecordSchema) -> None:
    for column in schema.standardized():
        if column.mean is None or column.std is None:
            raise ValueError(
                f"dense key {column.key!r} is standardized, but the layout has no mean "
                "and std for it (run the FDO job, which computes them)"
            )


def _columns(schema: RecordSchema) -> list[tuple[str, int, int, int]]:
    """`(key, wire kind, exact count or -1, hash buckets)` of every key read, in order."""
    columns = []
    for c in schema.sparse:
        if c.ids is IdType.BYTES:
            columns.append((c.key, BYTES_LIST, -1, c.hash_buckets))
        else:
            columns.append((c.key, INT64_LIST, -1, 0))
    columns += [(c.weights_key, FLOAT_LIST, -1, 0) for c in schema.sparse if c.weights_key]
    for c in schema.dense:
        kind = FLOAT_LIST if c.type is ValueType.FLOAT else INT64_LIST
        columns.append((c.key, kind, c.length if c.default is None else -1, 0))
    label_kind = FLOAT_LIST if schema.label.type is ValueType.FLOAT else INT64_LIST
    columns.append((schema.label.key, label_kind, 1, 0))
    return columns


@functools.lru_cache(maxsize=64)
def _wire_schema(layout: FeatureLayout) -> WireSchema:
    return WireSchema(*(list(column) for column in zip(*_columns(layout.schema), strict=True)))


# Names, not `tf` dtypes: TensorFlow is imported only when the fallback runs.
_TF_DTYPES = {BYTES_LIST: "string", INT64_LIST: "int64", FLOAT_LIST: "float32"}


@functools.lru_cache(maxsize=64)
def _tf_spec(layout: FeatureLayout) -> dict[str, tf.io.RaggedFeature]:
    return {
        key: tf.io.RaggedFeature(tf.as_dtype(_TF_DTYPES[kind]), row_splits_dtype=tf.int64)
        for key, kind, _, _ in _columns(layout.schema)
    }


@functools.lru_cache(maxsize=64)
def _tf_parser(layout: FeatureLayout) -> Callable[[tf.Tensor], dict[str, Any]]:
    """`tf.io.parse_example` of `layout` as one graph call.

    The parser maps `string[batch]` records to `(values, row_splits)` per key,
    bytes values hashed by `tf.strings.to_hash_bucket_fast`. Called eagerly,
    the parse takes TF's slow eager fallback and builds every `RaggedTensor`
    in Python, which costs more than the parse itself on a batch of a few
    hundred records.
    """
    spec = _tf_spec(layout)
    buckets = {key: n for key, kind, _, n in _columns(layout.schema) if kind == BYTES_LIST}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def parse(records: tf.Tensor) -> dict[str, Any]:
        parsed = tf.io.parse_example(records, spec)
        out = {}
        for key, ragged in parsed.items():
            values = ragged.values
            if key in buckets:
                values = tf.strings.to_hash_bucket_fast(values, buckets[key])
            out[key] = (values, ragged.row_splits)
        return out

    return parse


def _tf_parse(records: list[bytes], layout: FeatureLayout) -> dict[str, tuple]:
    """`{key: (values, row_splits)}` (numpy) from `tf.io.parse_example`.

    Raises:
      _BatchRejected: TF rejects the batch.
    """
    try:
        # A list: converted as a sequence, a `RecordBatch` would become
        # fixed-width bytes, which drop trailing zero bytes.
        tensors = _tf_parser(layout)(tf.constant(list(records), dtype=tf.string))
    # TF formats its message with the record's bytes, which need not be UTF-8.
    except (tf.errors.InvalidArgumentError, UnicodeDecodeError) as error:
        raise _BatchRejected("rejected by tf.io.parse_example") from error
    return {key: tuple(t.numpy() for t in value) for key, value in tensors.items()}


def _parse_batch(records: list[bytes], layout: FeatureLayout) -> ParsedBatch:
    """The fast path: one compiled (or else TF) parse and vectorized checks.

    Raises:
      _BatchRejected: TF rejects the batch, or a record fails the checks.
    """
    parsed = read_examples(records, _wire_schema(layout))
    if parsed is None:
        parsed = _tf_parse(records, layout)
    schema = layout.schema
    dense = DenseKeys.of(schema)
    dense_counts = dense.counts(parsed, len(records))
    for index in _suspect_rows(parsed, schema, dense.miscounted(dense_counts)):
        reason = _record_problem(records[index], schema)
        if reason:
            raise _BatchRejected(reason)
    ids = {c.name: RaggedIds(*parsed[c.key]) for c in schema.sparse}
    weights = {c.name: RaggedIds(*parsed[c.weights_key]) for c in schema.sparse if c.weights_key}
    label_values = parsed[schema.label.key][0]
    if schema.label.type is ValueType.FLOAT:
        labels = (label_values > schema.label.threshold).astype(np.int32)
    else:
        labels = label_values.astype(np.int32)
    return ParsedBatch(
        ids=ids, weights=weights, dense=dense.values(parsed, dense_counts), labels=labels
    )


def _suspect_rows(
    parsed: dict[str, tuple], schema: RecordSchema, dense_miscounted: np.ndarray
) -> np.ndarray:
    """`int64[k]` rows the batch parse cannot vouch for.

    Both parses read an absent key as an empty row, and look neither at
    values (labels, non-finite floats) nor at counts (weights against ids,
    dense lengths (`dense_miscounted`: `bool[batch]`), one label).
    """
    suspect = dense_miscounted.copy()
    for c in schema.sparse:
        lengths = np.diff(parsed[c.key][1])
        if c.required:
            suspect |= lengths == 0
        if c.weights_key:
            suspect |= np.diff(parsed[c.weights_key][1]) != lengths
    for c in schema.dense:
        if c.type is ValueType.FLOAT:
            values, splits = parsed[c.key]
            _mark_rows(suspect, splits, ~np.isfinite(values))
    values, splits = parsed[schema.label.key]
    suspect |= np.diff(splits) != 1
    if schema.label.type is ValueType.FLOAT:
        bad = ~np.isfinite(values)
    else:
        bad = (values != 0) & (values != 1)
    _mark_rows(suspect, splits, bad)
    return np.flatnonzero(suspect)


def _mark_rows(suspect: np.ndarray, splits: np.ndarray, bad: np.ndarray) -> None:
    """Sets `suspect[row]` for the row of every value where `bad` (`bool[nnz]`)."""
    if bad.any():
        suspect[np.repeat(np.arange(splits.size - 1), np.diff(splits))[bad]] = True


def _separate(
    records: list[bytes], layout: FeatureLayout
) -> tuple[ParsedBatch, list[tuple[int, str]]]:
    """Judges every record; returns the batch of good ones and the bad ones."""
    problems = {}
    for index, record in enumerate(records):
        reason = _record_problem(record, layout.schema)
        if reason:
            problems[index] = reason
    good = [index for index in range(len(records)) if index not in problems]
    try:
        batch = _parse_batch([records[index] for index in good], layout)
    except _BatchRejected:
        # TF's parser rejects a record that the checks above accept: let it
        # judge those records one at a time.
        for index in good:
            reason = _tf_problem(records[index], layout)
            if reason:
                problems[index] = reason
        good = [index for index in good if index not in problems]
        batch = _parse_batch([records[index] for index in good], layout)
    return batch, sorted(problems.items())


def _tf_problem(record: bytes, layout: FeatureLayout) -> str | None:
    # Eager, not `_tf_parser`: a graph's error message buries TF's reason
    # under the traceback of the node.
    try:
        tf.io.parse_example(tf.constant([record], dtype=tf.string), _tf_spec(layout))
    except (tf.errors.InvalidArgumentError, UnicodeDecodeError) as error:
        return f"rejected by tf.io.parse_example: {tf_error_reason(error)}"
    return None


def _record_problem(record: bytes, schema: RecordSchema) -> str | None:
    """Why one record does not match the schema, or None when it does."""
    try:
        example = tf.train.Example.FromString(record)
    except protobuf_message.DecodeError:
        return f"not a serialized tf.train.Example ({len(record)} bytes: {record[:32]!r}...)"
    features = example.features.feature
    for c in schema.sparse:
        kind = _BYTES if c.ids is IdType.BYTES else _INT64
        ids, reason = _values(features, c.key, kind, optional=not c.required)
        if reason:
            return reason
        if c.weights_key:
            weights, reason = _values(features, c.weights_key, _FLOAT, optional=not c.required)
            if reason:
                return reason
            if len(weights) != len(ids):
                return (
                    f"feature {c.weights_key!r} has {len(weights)} weights for "
                    f"{len(ids)} ids of {c.key!r}"
                )
    for c in schema.dense:
        reason = _dense_problem(features, c)
        if reason:
            return reason
    return _label_problem(features, schema)


def _dense_problem(features, column: DenseColumn) -> str | None:
    has_default = column.default is not None
    values, reason = _values(features, column.key, _LIST_NAMES[column.type], optional=has_default)
    if reason:
        return reason
    if len(values) != column.length and not (has_default and not values):
        what = "num_dense_features" if column.key == DENSE_KEY else "length"
        return f"feature {column.key!r} has {len(values)} values, expected {what} = {column.length}"
    bad = [value for value in values if not np.isfinite(value)]
    if bad:
        return f"feature {column.key!r} holds a non-finite value {bad[0]}"
    return None


def _label_problem(features, schema: RecordSchema) -> str | None:
    label = schema.label
    labels, reason = _values(features, label.key, _LIST_NAMES[label.type], optional=False)
    if reason:
        return reason
    if len(labels) != 1:
        return f"feature {label.key!r} has {len(labels)} values, expected exactly 1"
    if label.type is ValueType.FLOAT:
        if not np.isfinite(labels[0]):
            return f"feature {label.key!r} is {labels[0]}, expected a finite number"
    elif labels[0] not in (0, 1):
        return f"feature {label.key!r} is {labels[0]}, expected 0 or 1"
    return None


def _values(features, key: str, kind: str, *, optional: bool):
    """(values, None) of `features[key]`, or (None, reason) when it is unusable.

    A feature with no list set reads as empty (as TF reads it); so does an
    absent one when `optional`.
    """
    if key not in features:
        return ([], None) if optional else (None, f"missing feature {key!r}")
    feature = features[key]
    actual = feature.WhichOneof("kind")
    if actual is None:
        return [], None
    if actual != kind:
        return None, f"feature {key!r} holds a {actual or 'no value list'}, expected {kind}"
    return getattr(feature, kind).value, None
