"""Synthetic recommender datasets: Zipf ids, ragged valency, a learnable label.

Every example holds, per sparse feature, `valency ~ Uniform{min, ..., max}` ids
`(Zipf(zipf_exponent) - 1) mod vocabulary_size` (so small ids are the hot
ones), optionally one weight per id in [0.5, 1.5); `num_dense_features`
standard normal dense values; and a 0/1 label drawn as
`Bernoulli(sigmoid(logit))`, where

    term_f = the (weighted) mean over the sample's ids of feature f of score(f, id)
    term_dense = dense . w
    logit = scale * (sum over terms t of c_t * term_t  -  shift)

`score(f, id)` is a fixed pseudo-random N(0, 1) value per (seed, feature, id)
computed by hashing, so no table of vocabulary size is ever built; `w` is a
fixed random unit vector. On a calibration sample, `c_t = 1 / std(term_t)`
gives every feature and the dense part an equal share of the signal (so the
embeddings matter), and `shift`, `scale` center the sum and scale it to
standard deviation 1.3, which puts the Bayes-optimal AUC near 0.79 whatever
the feature configuration.

Generation runs in chunks of `_CHUNK` examples, chunk k drawn from its own
seeded stream, so the examples depend on the seed and the dataset only, not on
the sharding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from embedding import RaggedIds
from embedding.checks import check_int
from pipelines._errors import DataError
from pipelines._parse import FeatureLayout, ParsedBatch, serialize_examples
from pipelines._records import RecordFileWriter, RecordFormat

_log = logging.getLogger(__name__)

_CHUNK = 4096
_CALIBRATION_EXAMPLES = 8192
# Multiplier of the standardized logit: Bayes-optimal AUC ~0.79 for a normal logit.
_LABEL_SHARPNESS = 1.3
_WEIGHT_RANGE = (0.5, 1.5)
# Seed-sequence spawn keys of the independent random streams.
_EXAMPLE_STREAM = 0
_DENSE_WEIGHT_STREAM = 1
_CALIBRATION_STREAM = 2
_HELD_OUT_EXAMPLE_STREAM = 3
MANIFEST_NAME = "dataset.json"
_MANIFEST_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticFeature:
    """One synthetic sparse feature.

    Attributes:
      name: record key of the ids (weights go under `<name>_weights`).
      vocabulary_size: ids lie in `[0, vocabulary_size)`.
      min_valency: fewest ids per sample (>= 1).
      max_valency: most ids per sample.
      zipf_exponent: the Zipf parameter `a > 1`; smaller is more uniform.
      weighted: whether the feature carries one positive weight per id.
    """

    name: str
    vocabulary_size: int
    min_valency: int
    max_valency: int
    zipf_exponent: float
    weighted: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(
                f"SyntheticFeature name must be a non-empty string, got {self.name!r}."
            )
        check_int(self.vocabulary_size, f"Feature {self.name!r}: vocabulary_size", 1)
        check_int(self.min_valency, f"Feature {self.name!r}: min_valency", 1)
        check_int(self.max_valency, f"Feature {self.name!r}: max_valency", self.min_valency)
        exponent = self.zipf_exponent
        if isinstance(exponent, bool) or not isinstance(exponent, int | float):
            raise TypeError(
                f"Feature {self.name!r}: zipf_exponent must be a number, got {exponent!r}."
            )
        if not exponent > 1 or not math.isfinite(exponent):
            raise ValueError(
                f"Feature {self.name!r}: zipf_exponent must be a finite number > 1 "
                f"(numpy's Zipf), got {exponent!r}; use e.g. 1.05 for a flat distribution."
            )
        if not isinstance(self.weighted, bool):
            raise TypeError(
                f"Feature {self.name!r}: weighted must be a bool, got {self.weighted!r}."
            )
        object.__setattr__(self, "zipf_exponent", float(exponent))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticDataset:
    """A synthetic dataset's features.

    Attributes:
      features: the sparse features (names unique).
      num_dense_features: length of each example's `dense` float list (>= 0).
    """

    features: tuple[SyntheticFeature, ...]
    num_dense_features: int

    def __post_init__(self):
        object.__setattr__(self, "features", tuple(self.features))
        for feature in self.features:
            if not isinstance(feature, SyntheticFeature):
                raise TypeError(f"features must be SyntheticFeature objects, got {feature!r}.")
        # Validates names and counts: the layout is what a reader will use.
        self.feature_layout()

    def feature_layout(self) -> FeatureLayout:
        """The `FeatureLayout` that parses this dataset's records."""
        return FeatureLayout(
            sparse=tuple(feature.name for feature in self.features),
            weighted=frozenset(feature.name for feature in self.features if feature.weighted),
            num_dense_features=self.num_dense_features,
        )


def write_synthetic_dataset(
    dataset: SyntheticDataset,
    out_dir: str | os.PathLike,
    *,
    num_examples: int,
    seed: int,
    num_shards: int = 4,
    formats: Sequence[str] = ("arrayrecord", "tfrecord"),
    held_out: bool = False,
) -> dict[str, list[str]]:
    """Writes a synthetic dataset as sharded files of serialized `tf.train.Example`.

    Writes `out_dir/<format>/part-SSSSS-of-NNNNN.<ext>` per format and shard,
    then `out_dir/dataset.json` (the arguments, the features and the file
    lists), which is written last and so marks a complete dataset. Shards are
    contiguous blocks of the global example order: shard s holds examples
    `[s * num_examples // num_shards, (s + 1) * num_examples // num_shards)`,
    so reading the shards in order reads the examples in order. Every format
    holds the same records in the same order, and the records depend only on
    `dataset`, `num_examples` and `seed` (not on `num_shards`). Each file is
    written under a hidden temporary name and renamed when complete.

    Args:
      dataset: the features.
      out_dir: output directory (created if needed).
      num_examples: total examples (>= num_shards).
      seed: random seed (>= 0).
      num_shards: files per format.
      formats: any of "arrayrecord" and "tfrecord".
      held_out: write the held-out split of the same seed instead: examples
        of the same distribution (the same labelling function) drawn from an
        independent stream, for evaluating a model trained on the training
        split.

    Returns:
      Per format name, its file paths in shard order.

    Raises:
      ValueError: a bad argument, or `out_dir` already holds shards of another
        shard count (they would mix with the new ones).
    """
    if not isinstance(dataset, SyntheticDataset):
        raise TypeError(f"dataset must be a SyntheticDataset, got {type(dataset).__name__}.")
    check_int(num_examples, "num_examples", 1)
    check_int(seed, "seed", 0)
    check_int(num_shards, "num_shards", 1)
    if num_shards > num_examples:
        raise ValueError(
            f"num_shards = {num_shards} exceeds num_examples = {num_examples}; "
            "lower num_shards so that every shard holds an example."
        )
    formats = _record_formats(formats)
    out_dir = os.fspath(out_dir)
    names = [_shard_name(shard, num_shards) for shard in range(num_shards)]
    paths = {
        fmt: [os.path.join(out_dir, fmt.value, name + fmt.extension) for name in names]
        for fmt in formats
    }
    _prepare_directories(out_dir, paths)
    start = time.perf_counter()
    _write_shards(_example_records(dataset, num_examples, seed, held_out), num_examples, paths)
    _write_manifest(out_dir, dataset, num_examples, seed, num_shards, paths, held_out)
    seconds = time.perf_counter() - start
    _log.info(
        "Wrote %d synthetic examples to %s in %.1f s (%.0f examples/s).",
        num_examples,
        out_dir,
        seconds,
        num_examples / seconds,
    )
    return {fmt.value: list(files) for fmt, files in paths.items()}


def _record_formats(formats: Sequence[str]) -> list[RecordFormat]:
    if isinstance(formats, str):
        formats = [formats]
    try:
        result = [RecordFormat(fmt) for fmt in formats]
    except ValueError:
        known = [fmt.value for fmt in RecordFormat]
        raise ValueError(f"formats must be taken from {known}, got {list(formats)}.") from None
    if not result or len(set(result)) != len(result):
        raise ValueError(
            f"formats must name each format at most once, and at least one; got {formats}."
        )
    return result


def _shard_bounds(num_examples: int, num_shards: int) -> list[int]:
    """Shard s holds examples `[bounds[s], bounds[s + 1])`: contiguous, sizes within 1."""
    return [shard * num_examples // num_shards for shard in range(num_shards + 1)]


def _shard_name(shard: int, num_shards: int) -> str:
    return f"part-{shard:05d}-of-{num_shards:05d}"


def _prepare_directories(out_dir: str, paths: dict[RecordFormat, list[str]]) -> None:
    """Creates the directories; refuses to mix with shards of another write."""
    for fmt, files in paths.items():
        directory = os.path.dirname(files[0])
        os.makedirs(directory, exist_ok=True)
        expected = {os.path.basename(path) for path in files}
        stale = sorted(
            name
            for name in os.listdir(directory)
            if name.startswith("part-") and name.endswith(fmt.extension) and name not in expected
        )
        if stale:
            raise DataError(
                f"{directory} already holds shards of another write ({stale[:3]}...); "
                "remove them or choose another output directory."
            )
    # Until the new manifest is written, the directory is not a complete dataset.
    manifest = os.path.join(out_dir, MANIFEST_NAME)
    if os.path.exists(manifest):
        os.remove(manifest)


def _write_shards(
    records: Iterator[bytes], num_examples: int, paths: dict[RecordFormat, list[str]]
) -> None:
    bounds = _shard_bounds(num_examples, len(next(iter(paths.values()))))
    for shard in range(len(bounds) - 1):
        with contextlib.ExitStack() as stack:
            writers = [
                stack.enter_context(RecordFileWriter(files[shard])) for files in paths.values()
            ]
            for record in itertools.islice(records, bounds[shard + 1] - bounds[shard]):
                for writer in writers:
                    writer.write(record)


def _write_manifest(
    out_dir: str,
    dataset: SyntheticDataset,
    num_examples: int,
    seed: int,
    num_shards: int,
    paths: dict[RecordFormat, list[str]],
    held_out: bool,
) -> None:
    manifest = {
        "version": _MANIFEST_VERSION,
        "num_examples": num_examples,
        "seed": seed,
        "held_out": held_out,
        "num_shards": num_shards,
        "examples_per_shard": np.diff(_shard_bounds(num_examples, num_shards)).tolist(),
        "num_dense_features": dataset.num_dense_features,
        "features": [dataclasses.asdict(feature) for feature in dataset.features],
        "files": {
            fmt.value: [os.path.relpath(path, out_dir) for path in files]
            for fmt, files in paths.items()
        },
    }
    path = os.path.join(out_dir, MANIFEST_NAME)
    temp_path = os.path.join(out_dir, f".{MANIFEST_NAME}.{os.getpid()}.tmp")
    text = json.dumps(manifest, indent=2) + "\n"
    with open(temp_path, "w") as file:
        file.write(text)
    os.replace(temp_path, path)


def _example_records(
    dataset: SyntheticDataset, num_examples: int, seed: int, held_out: bool
) -> Iterator[bytes]:
    batches = generate_examples(dataset, num_examples=num_examples, seed=seed, held_out=held_out)
    for batch in batches:
        yield from serialize_examples(batch)


def generate_examples(
    dataset: SyntheticDataset, *, num_examples: int, seed: int, held_out: bool = False
) -> Iterator[ParsedBatch]:
    """The dataset's examples, in order, as batches of at most `_CHUNK` examples.

    These are exactly the examples `write_synthetic_dataset` writes for the
    same arguments.
    """
    model = _label_model(dataset, seed)
    stream = _HELD_OUT_EXAMPLE_STREAM if held_out else _EXAMPLE_STREAM
    for chunk, start in enumerate(range(0, num_examples, _CHUNK)):
        rng = _rng(seed, stream, chunk)
        batch = _draw_inputs(dataset, rng, min(_CHUNK, num_examples - start))
        probabilities = _sigmoid(_logits(dataset, seed, batch, model))
        labels = (rng.random(probabilities.size) < probabilities).astype(np.int32)
        yield batch._replace(labels=labels)


def label_logits(dataset: SyntheticDataset, seed: int, batch: ParsedBatch) -> np.ndarray:
    """`float64[batch]` the true logits of the labels of `batch`'s examples.

    The label of each example was drawn as `Bernoulli(sigmoid(logit))`: this is
    the Bayes-optimal score, the ceiling a model can reach.
    """
    return _logits(dataset, seed, batch, _label_model(dataset, seed))


class _LabelModel(NamedTuple):
    """The fixed parts of the logit.

    Attributes:
      dense_weights: `float64[num_dense_features]`, unit norm.
      term_weights: `float64[num_features + 1]` multipliers of the terms
        (sparse features in order, then dense).
      shift: subtracted from the weighted sum of terms (centers the labels).
      scale: multiplies the centered sum.
    """

    dense_weights: np.ndarray
    term_weights: np.ndarray
    shift: float
    scale: float


def _label_model(dataset: SyntheticDataset, seed: int) -> _LabelModel:
    dense_weights = _rng(seed, _DENSE_WEIGHT_STREAM).standard_normal(dataset.num_dense_features)
    if dense_weights.size:
        dense_weights /= np.linalg.norm(dense_weights)
    sample = _draw_inputs(dataset, _rng(seed, _CALIBRATION_STREAM), _CALIBRATION_EXAMPLES)
    terms = _terms(dataset, seed, sample, dense_weights)
    # A constant term (a one-id vocabulary, no dense features) gets no weight;
    # if all are constant, the labels are fair coins.
    term_weights = _reciprocal_or_zero(terms.std(axis=0))
    raw = terms @ term_weights
    scale = _LABEL_SHARPNESS * _reciprocal_or_zero(raw.std())
    return _LabelModel(dense_weights, term_weights, shift=float(raw.mean()), scale=float(scale))


def _reciprocal_or_zero(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return np.divide(1.0, x, out=np.zeros_like(x), where=x > 1e-12)


def _logits(
    dataset: SyntheticDataset, seed: int, batch: ParsedBatch, model: _LabelModel
) -> np.ndarray:
    terms = _terms(dataset, seed, batch, model.dense_weights)
    return model.scale * (terms @ model.term_weights - model.shift)


def _terms(
    dataset: SyntheticDataset, seed: int, batch: ParsedBatch, dense_weights: np.ndarray
) -> np.ndarray:
    """`float64[batch, num_features + 1]` each feature's mean id score, then dense . w."""
    columns = []
    for index, feature in enumerate(dataset.features):
        ids = batch.ids[feature.name]
        weights = batch.weights.get(feature.name)
        scores = id_scores(seed, index, ids.values)
        columns.append(
            _row_means(scores, None if weights is None else weights.values, ids.row_splits)
        )
    columns.append(batch.dense.astype(np.float64) @ dense_weights)
    return np.stack(columns, axis=1)


def _row_means(
    values: np.ndarray, weights: np.ndarray | None, row_splits: np.ndarray
) -> np.ndarray:
    """`float64[rows]` the (weighted) mean of each row's values; 0 for an empty row."""
    lengths = np.diff(row_splits)
    rows = np.repeat(np.arange(lengths.size), lengths)
    weights = np.ones(values.size) if weights is None else weights.astype(np.float64)
    totals = np.bincount(rows, weights=weights * values, minlength=lengths.size)
    norms = np.bincount(rows, weights=weights, minlength=lengths.size)
    return totals / np.where(norms > 0, norms, 1.0)


def id_scores(seed: int, feature_index: int, ids: np.ndarray) -> np.ndarray:
    """`float64[n]` the fixed N(0, 1) score of each id of one feature.

    A splitmix64 hash of (seed, feature, id) gives two 32-bit uniforms, which
    Box-Muller turns into a normal value.
    """
    salt = _mix64(_mix64(np.array([seed % 2**64], np.uint64)) ^ np.uint64(feature_index))
    bits = _mix64(np.asarray(ids).astype(np.uint64) ^ salt)
    uniform_1 = ((bits >> np.uint64(32)).astype(np.float64) + 1.0) / 2.0**32
    uniform_2 = (bits & np.uint64(0xFFFFFFFF)).astype(np.float64) / 2.0**32
    return np.sqrt(-2.0 * np.log(uniform_1)) * np.cos(2.0 * np.pi * uniform_2)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, a bijection of uint64 (wraps modulo 2**64)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _draw_inputs(dataset: SyntheticDataset, rng: np.random.Generator, count: int) -> ParsedBatch:
    """Draws `count` examples' ids, weights and dense values (labels left empty)."""
    ids, weights = {}, {}
    for feature in dataset.features:
        lengths = rng.integers(feature.min_valency, feature.max_valency + 1, size=count)
        row_splits = np.zeros(count + 1, np.int64)
        np.cumsum(lengths, out=row_splits[1:])
        values = (
            rng.zipf(feature.zipf_exponent, size=int(row_splits[-1])) - 1
        ) % feature.vocabulary_size
        ids[feature.name] = RaggedIds(values=values.astype(np.int64), row_splits=row_splits)
        if feature.weighted:
            drawn = rng.uniform(*_WEIGHT_RANGE, size=values.size).astype(np.float32)
            weights[feature.name] = RaggedIds(values=drawn, row_splits=row_splits)
    dense = rng.standard_normal((count, dataset.num_dense_features)).astype(np.float32)
    return ParsedBatch(ids=ids, weights=weights, dense=dense, labels=np.zeros(0, np.int32))


def _rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=stream))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # The tanh form cannot overflow.
    return 0.5 * (1.0 + np.tanh(0.5 * x))
