"""Serialized `tf.train.Example` records <-> ragged id batches.

The record schema, shared by the synthetic writer and the parser:

  `<feature>`          int64 list: the sample's ids (may be empty, must be present).
  `<feature>_weights`  float list: one weight per id, for weighted features only.
  `dense`              float list of exactly `num_dense_features` values
                       (only read when `num_dense_features > 0`).
  `label`              int64 list holding exactly one value, 0 or 1.

`parse_examples` parses a whole batch in one compiled pass over the wire
format (`_example_wire.py`), or, for records that pass does not vouch for,
with one `tf.io.parse_example` call, and checks the result with numpy. Only
when that fails are the records judged one by one, so a clean batch pays
nothing for the per-record diagnosis, and a bad record is named (index within
the batch, and why) instead of failing the batch with TF's message.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from google.protobuf import message as protobuf_message

from embedding import RaggedIds
from pipelines._errors import DataError
from pipelines._example_wire import FLOAT_LIST, INT64_LIST, WireSchema, read_examples
from pipelines._records import tf_error_reason
from pipelines._tensorflow import tf

DENSE_KEY = "dense"
LABEL_KEY = "label"
_INT64 = "int64_list"
_FLOAT = "float_list"


def weights_key(feature: str) -> str:
    """The record key of a weighted feature's weights."""
    return f"{feature}_weights"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureLayout:
    """What a record holds, i.e. what `parse_examples` reads from it.

    Attributes:
      sparse: the sparse feature names, in output order.
      weighted: the sparse features that also carry `<name>_weights`.
      num_dense_features: length of the `dense` float list (0: not read).
    """

    sparse: tuple[str, ...]
    weighted: frozenset[str] = frozenset()
    num_dense_features: int = 0

    def __post_init__(self):
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
        count = self.num_dense_features
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"num_dense_features must be an integer >= 0, got {count!r}.")
        keys = self.record_keys()
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        if repeated:
            raise ValueError(
                f"Record keys {repeated} are used twice (keys: {keys}); rename the "
                f"features so that no name repeats or equals {DENSE_KEY!r}, "
                f"{LABEL_KEY!r} or another weighted feature's '<name>_weights'."
            )

    def record_keys(self) -> list[str]:
        """Every key a record of this layout holds."""
        weights = [weights_key(name) for name in self.sparse if name in self.weighted]
        return [*self.sparse, *weights, DENSE_KEY, LABEL_KEY]


class ParsedBatch(NamedTuple):
    """A parsed batch of records (host numpy arrays).

    Attributes:
      ids: per sparse feature, `RaggedIds` with `int64[nnz]` values and
        `int64[batch + 1]` row splits.
      weights: per weighted feature, `RaggedIds` with `float32[nnz]` values and
        the same row splits as its ids; unweighted features are absent.
      dense: `float32[batch, num_dense_features]`.
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
      BadRecordError: a record is not an Example, lacks a feature, holds the
        wrong value type or count, has a label other than 0/1, or has weights
        whose count differs from its ids'. Names the first bad record.
    """
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


def _as_record_list(records: Sequence[bytes]) -> list[bytes]:
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


@functools.lru_cache(maxsize=64)
def _tf_spec(layout: FeatureLayout) -> dict[str, tf.io.RaggedFeature | tf.io.FixedLenFeature]:
    spec = {}
    for name in layout.sparse:
        spec[name] = tf.io.RaggedFeature(tf.int64, row_splits_dtype=tf.int64)
        if name in layout.weighted:
            spec[weights_key(name)] = tf.io.RaggedFeature(tf.float32, row_splits_dtype=tf.int64)
    if layout.num_dense_features:
        spec[DENSE_KEY] = tf.io.FixedLenFeature([layout.num_dense_features], tf.float32)
    spec[LABEL_KEY] = tf.io.FixedLenFeature([], tf.int64)
    return spec


@functools.lru_cache(maxsize=64)
def _tf_parser(layout: FeatureLayout) -> Callable[[tf.Tensor], dict[str, Any]]:
    """`tf.io.parse_example` of `layout` as one graph call.

    The parser maps `string[batch]` records to a dict: `(values, row_splits)`
    per ragged feature, the tensor per fixed-length one. Called eagerly, the
    parse takes TF's slow eager fallback and builds every `RaggedTensor` in
    Python, which costs more than the parse itself on a batch of a few
    hundred records.
    """
    spec = _tf_spec(layout)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def parse(records: tf.Tensor) -> dict[str, Any]:
        parsed = tf.io.parse_example(records, spec)
        return {
            key: (value.values, value.row_splits) if isinstance(value, tf.RaggedTensor) else value
            for key, value in parsed.items()
        }

    return parse


def _parse_batch(records: list[bytes], layout: FeatureLayout) -> ParsedBatch:
    """The fast path: one compiled (or else TF) parse and vectorized checks.

    Raises:
      _BatchRejected: TF rejects the batch, or a record fails the checks.
    """
    parsed = read_examples(records, _wire_schema(layout))
    if parsed is None:
        parsed = _tf_parse(records, layout)
    ids = {name: RaggedIds(*parsed[name]) for name in layout.sparse}
    weights = {
        name: RaggedIds(*parsed[weights_key(name)])
        for name in layout.sparse
        if name in layout.weighted
    }
    labels = parsed[LABEL_KEY][0]
    for index in _suspect_rows(ids, weights, labels):
        reason = _record_problem(records[index], layout)
        if reason:
            raise _BatchRejected(reason)
    dense = parsed[DENSE_KEY][0] if layout.num_dense_features else np.zeros(0, np.float32)
    return ParsedBatch(
        ids=ids,
        weights=weights,
        dense=dense.reshape(len(records), layout.num_dense_features),
        labels=labels.astype(np.int32),
    )


@functools.lru_cache(maxsize=64)
def _wire_schema(layout: FeatureLayout) -> WireSchema:
    keys = [(name, INT64_LIST, -1) for name in layout.sparse]
    keys += [
        (weights_key(name), FLOAT_LIST, -1) for name in layout.sparse if name in layout.weighted
    ]
    if layout.num_dense_features:
        keys.append((DENSE_KEY, FLOAT_LIST, layout.num_dense_features))
    keys.append((LABEL_KEY, INT64_LIST, 1))
    return WireSchema(*(list(column) for column in zip(*keys, strict=True)))


def _tf_parse(records: list[bytes], layout: FeatureLayout) -> dict[str, tuple]:
    """`{key: (values, row_splits or None)}` (numpy) from `tf.io.parse_example`.

    Raises:
      _BatchRejected: TF rejects the batch.
    """
    try:
        tensors = _tf_parser(layout)(tf.constant(records, dtype=tf.string))
    # TF formats its message with the record's bytes, which need not be UTF-8.
    except (tf.errors.InvalidArgumentError, UnicodeDecodeError) as error:
        raise _BatchRejected("rejected by tf.io.parse_example") from error
    return {
        key: tuple(t.numpy() for t in value) if isinstance(value, tuple) else (value.numpy(), None)
        for key, value in tensors.items()
    }


def _suspect_rows(
    ids: dict[str, RaggedIds], weights: dict[str, RaggedIds], labels: np.ndarray
) -> np.ndarray:
    """`int64[k]` rows the batch parse cannot vouch for.

    TF's ragged parse reads an absent feature as an empty row, and does not
    look at label values or compare weight and id counts.
    """
    suspect = (labels != 0) & (labels != 1)
    for name, ragged in ids.items():
        lengths = np.diff(ragged.row_splits)
        suspect |= lengths == 0
        if name in weights:
            suspect |= np.diff(weights[name].row_splits) != lengths
    return np.flatnonzero(suspect)


def _separate(
    records: list[bytes], layout: FeatureLayout
) -> tuple[ParsedBatch, list[tuple[int, str]]]:
    """Judges every record; returns the batch of good ones and the bad ones."""
    problems = {}
    for index, record in enumerate(records):
        reason = _record_problem(record, layout)
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


def _record_problem(record: bytes, layout: FeatureLayout) -> str | None:
    """Why one record does not match the layout, or None when it does."""
    try:
        example = tf.train.Example.FromString(record)
    except protobuf_message.DecodeError:
        return f"not a serialized tf.train.Example ({len(record)} bytes: {record[:32]!r}...)"
    features = example.features.feature
    for name in layout.sparse:
        ids, reason = _values(features, name, _INT64, empty_ok=True)
        if reason:
            return reason
        if name in layout.weighted:
            weights, reason = _values(features, weights_key(name), _FLOAT, empty_ok=True)
            if reason:
                return reason
            if len(weights) != len(ids):
                return (
                    f"feature {weights_key(name)!r} has {len(weights)} weights for "
                    f"{len(ids)} ids of {name!r}"
                )
    if layout.num_dense_features:
        dense, reason = _values(features, DENSE_KEY, _FLOAT)
        if reason:
            return reason
        if len(dense) != layout.num_dense_features:
            return (
                f"feature {DENSE_KEY!r} has {len(dense)} values, expected "
                f"num_dense_features = {layout.num_dense_features}"
            )
    return _label_problem(features)


def _label_problem(features) -> str | None:
    labels, reason = _values(features, LABEL_KEY, _INT64)
    if reason:
        return reason
    if len(labels) != 1:
        return f"feature {LABEL_KEY!r} has {len(labels)} values, expected exactly 1"
    if labels[0] not in (0, 1):
        return f"feature {LABEL_KEY!r} is {labels[0]}, expected 0 or 1"
    return None


def _values(features, key: str, kind: str, *, empty_ok: bool = False):
    """(values, None) of `features[key]`, or (None, reason) when it is unusable.

    `empty_ok`: a feature with no list set reads as empty (as TF reads it).
    """
    if key not in features:
        return None, f"missing feature {key!r}"
    feature = features[key]
    actual = feature.WhichOneof("kind")
    if actual is None and empty_ok:
        return [], None
    if actual != kind:
        return None, f"feature {key!r} holds a {actual or 'no value list'}, expected {kind}"
    return getattr(feature, kind).value, None
