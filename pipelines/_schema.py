"""What a record holds: the keys, value types and defaults the parser reads.

A `RecordSchema` maps the keys of a `tf.train.Example` to a model's inputs:
per sparse feature the key of its ids (int64, or bytes hashed into the
table's vocabulary as `tf.strings.to_hash_bucket_fast` does) and of its
optional weights; the dense values (scalar keys, or list keys of a fixed
length) with a default for a missing key and a transform; and the label
(an int 0/1, or a float cut at a threshold). `RecordSchema.fixed` is the
layout the synthetic writer produces (`_parse.py`).
"""

from __future__ import annotations

import dataclasses
import enum
import math

from embedding.checks import check_int, check_positive_int

DENSE_KEY = "dense"
LABEL_KEY = "label"


def weights_key(feature: str) -> str:
    """The record key of a weighted feature's weights in the fixed layout."""
    return f"{feature}_weights"


class IdType(enum.Enum):
    """How a sparse feature's ids are stored."""

    INT64 = "int64"
    BYTES = "bytes"  # hashed: FarmHash Fingerprint64 % the table's vocabulary size


class ValueType(enum.Enum):
    """A dense value's or label's list type in the record."""

    FLOAT = "float"
    INT = "int"


class DenseTransform(enum.Enum):
    """What the input pipeline applies to a dense value."""

    NONE = "none"
    LOG1P = "log1p"  # log(1 + max(x, 0)), as DLRM does for Criteo's counts
    STANDARDIZE = "standardize"  # (x - mean) / std over the training data


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseColumn:
    """Where a sparse feature's ids (and weights) are in a record.

    Attributes:
      name: the feature.
      key: the record key of its ids.
      ids: their type; `BYTES` ids are hashed into `hash_buckets` rows.
      hash_buckets: the table's vocabulary size (only for `BYTES`).
      weights_key: the record key of one float weight per id (None: unweighted).
      required: a record without `key` is bad; otherwise it has no ids.
    """

    name: str
    key: str
    ids: IdType = IdType.INT64
    hash_buckets: int | None = None
    weights_key: str | None = None
    required: bool = False

    def __post_init__(self):
        object.__setattr__(self, "ids", IdType(self.ids))
        if self.ids is IdType.BYTES:
            if self.hash_buckets is None:
                raise ValueError(
                    f"feature {self.name!r} has bytes ids, which are hashed into the "
                    "table's vocabulary: hash_buckets (the vocabulary size) is required"
                )
            check_positive_int(self.hash_buckets, f"feature {self.name!r}: hash_buckets")
        elif self.hash_buckets is not None:
            raise ValueError(f"feature {self.name!r} has int64 ids: hash_buckets must be None")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseColumn:
    """One record key of dense values.

    Attributes:
      key: the record key.
      length: values under `key` in every record.
      type: float or int list (int values are read as float32).
      default: the value of each of the `length` values when the record lacks
        `key` (or holds it empty); None: such a record is bad.
      transform: applied after the default.
      mean, std: per value, the training data's moments (`STANDARDIZE` only;
        the parser refuses a standardized column without them).
    """

    key: str
    length: int = 1
    type: ValueType = ValueType.FLOAT
    default: float | None = None
    transform: DenseTransform = DenseTransform.NONE
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "type", ValueType(self.type))
        object.__setattr__(self, "transform", DenseTransform(self.transform))
        check_positive_int(self.length, f"dense key {self.key!r}: length")
        if self.default is not None and not math.isfinite(self.default):
            raise ValueError(f"dense key {self.key!r}: default must be finite, got {self.default}")
        for name in ("mean", "std"):
            values = getattr(self, name)
            if values is None:
                continue
            values = tuple(float(v) for v in values)
            object.__setattr__(self, name, values)
            if len(values) != self.length or not all(math.isfinite(v) for v in values):
                raise ValueError(
                    f"dense key {self.key!r}: {name} must hold {self.length} finite values, "
                    f"got {values}"
                )
        if self.std is not None and min(self.std) <= 0:
            raise ValueError(f"dense key {self.key!r}: std must be > 0, got {self.std}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LabelColumn:
    """Where the label is: an int 0/1, or a float whose label is `value > threshold`."""

    key: str = LABEL_KEY
    type: ValueType = ValueType.INT
    threshold: float = 0.5

    def __post_init__(self):
        object.__setattr__(self, "type", ValueType(self.type))
        if isinstance(self.threshold, bool) or not math.isfinite(self.threshold):
            raise ValueError(f"label threshold must be a finite number, got {self.threshold!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecordSchema:
    """A record's keys and how they become ids, weights, dense values and a label.

    Attributes:
      sparse: per sparse feature, in output order.
      dense: the dense keys, in the order of the model's dense input.
      label: the label's key and type.
    """

    sparse: tuple[SparseColumn, ...]
    dense: tuple[DenseColumn, ...] = ()
    label: LabelColumn = LabelColumn()

    def __post_init__(self):
        object.__setattr__(self, "sparse", tuple(self.sparse))
        object.__setattr__(self, "dense", tuple(self.dense))
        if not self.sparse:
            raise ValueError("a record schema needs at least one sparse feature")
        keys = self.record_keys()
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        if repeated:
            raise ValueError(f"record keys {repeated} are read twice (keys: {keys})")

    @classmethod
    def fixed(
        cls, sparse: tuple[str, ...], weighted: frozenset[str], num_dense_features: int
    ) -> RecordSchema:
        """The fixed layout: `<feature>` int64 ids (present, maybe empty), weights under
        `<feature>_weights`, `num_dense_features` floats under `dense`, `label` 0/1."""
        check_int(num_dense_features, "num_dense_features", 0)
        return cls(
            sparse=tuple(
                SparseColumn(
                    name=name,
                    key=name,
                    weights_key=weights_key(name) if name in weighted else None,
                    required=True,
                )
                for name in sparse
            ),
            dense=(DenseColumn(key=DENSE_KEY, length=num_dense_features),)
            if num_dense_features
            else (),
        )

    @property
    def num_dense_features(self) -> int:
        """Width of the dense input: the values of every dense key."""
        return sum(column.length for column in self.dense)

    def record_keys(self) -> list[str]:
        """Every key the parser reads."""
        keys = [column.key for column in self.sparse]
        keys += [column.weights_key for column in self.sparse if column.weights_key]
        return [*keys, *(column.key for column in self.dense), self.label.key]

    def standardized(self) -> tuple[DenseColumn, ...]:
        """The dense keys whose values are standardized."""
        return tuple(c for c in self.dense if c.transform is DenseTransform.STANDARDIZE)

    def with_moments(self, moments: dict[str, tuple[list[float], list[float]]]) -> RecordSchema:
        """This schema with `(mean, std)` per standardized key (`moments[key]`)."""
        missing = [c.key for c in self.standardized() if c.key not in moments]
        if missing:
            raise ValueError(f"no mean and std of the standardized dense keys {missing}")
        dense = tuple(
            dataclasses.replace(c, mean=tuple(moments[c.key][0]), std=tuple(moments[c.key][1]))
            if c.transform is DenseTransform.STANDARDIZE
            else c
            for c in self.dense
        )
        return dataclasses.replace(self, dense=dense)

    def without_standardization(self) -> RecordSchema:
        """This schema with the standardized keys read raw (to compute their moments)."""
        dense = tuple(
            dataclasses.replace(c, transform=DenseTransform.NONE, mean=None, std=None)
            if c.transform is DenseTransform.STANDARDIZE
            else c
            for c in self.dense
        )
        return dataclasses.replace(self, dense=dense)
