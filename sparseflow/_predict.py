"""Batch prediction: a run's newest checkpoint scoring every record of a dataset, in order.

The records are read in file order and cut into the config's global batches;
each batch is parsed and laid out as the trainer's input lays its batches out
(`pipelines.PreprocessStage`) and scored by the trainer's own evaluation
forward (`Stages.eval_logits`) on the checkpoint's dense parameters and
tables, restored as a resumed run restores them (from a checkpoint of
another mesh, laid out for this one; a pipelined run's batches in flight are
left unread). Unlike training, every record is scored once:

* the last batch is padded with copies of one of its records, whose scores
  are not kept;
* no id is dropped: the limits are the checkpoint's, and a batch that needs
  more raises them as training does (`_limit_feedback.FeedbackIterator`),
  or is split into minibatches where the config enables them;
* a record without a label is scored all the same (its label is left out);
* a bad record stops the run naming it, or, with
  `preprocessing.on_bad_record: skip`, is logged, counted and given no score.

One process: a helper thread lays out the next batch while the devices
score the current one (its forward dispatched, its scores read a batch later).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import logging
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import tqdm
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import embedding
import pipelines
from sparseflow import _dense_model, _limit_feedback, _mesh_change, _run_identity, _train
from sparseflow._checkpoint import Checkpoints, Reading, Snapshot
from sparseflow._dict_params import reading_dict_params
from sparseflow._errors import UsageError
from sparseflow._steps import DenseInputs
from sparseflow.config._run_config import RunConfig

_log = logging.getLogger(__name__)

# The entries of a run's identity that the checkpoint's arrays depend on.
_MODEL_IDENTITY = ("mesh", "tables", "features", "dense_features", "model")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PredictOptions:
    """One `sparseflow predict` invocation (the config holds the rest).

    Attributes:
      checkpoint_dir: the run's checkpoints; the newest that reads is used.
      data: ArrayRecord files, directories or globs of the records to score.
      keep: record keys whose values go with each score (e.g. a request id).
      fdo_dir: the FDO output whose dense moments standardize dense keys
        (needed only when the config standardizes some).
      model: the Flax NNX model class the run trained in place of the
        config's `model.module` (as `sparseflow.Trainer` took it).
      batch_size: records scored per forward; None for the config's global
        batch. Like it, a multiple of devices x partitions_per_device. A
        forward keeps no gradients or optimizer state, so it has room for
        a larger batch than training, and on a mesh of several devices each
        forward's collectives cost the same whatever its batch; the limits
        the checkpoint brings are raised on the first batch that needs more.
      progress: show a progress bar.
    """

    checkpoint_dir: Path
    data: str | Sequence[str]
    keep: Sequence[str] = ()
    fdo_dir: Path | None = None
    model: type | None = None
    batch_size: int | None = None
    progress: bool = True


class Predictions(NamedTuple):
    """One row per record of the data, in input order.

    Attributes:
      step: the step of the checkpoint that scored them.
      scores: `float32[records]`, the model's output (the logit, for the
        shipped towers); NaN for a bad record that was skipped.
      labels: `int32[records]`, each record's label; -1 where it has none
        (or is bad).
      bad_records: the dataset indices of the bad records skipped.
      examples_per_s: records scored per second after the first batch (whose
        time is mostly compiling the forward); NaN for a single batch.
      kept: per `PredictOptions.keep` key, each record's value (a scalar for
        one value, a list for several, None when absent).
    """

    step: int
    scores: np.ndarray
    labels: np.ndarray
    bad_records: list[int]
    examples_per_s: float
    kept: dict[str, list]


def predict(config: RunConfig, options: PredictOptions) -> Predictions:
    """Scores every record of `options.data` with the newest checkpoint of the run of `config`.

    Raises:
      UsageError: no checkpoint, several processes, or a model whose outputs
        are not one score per record.
      CheckpointMismatchError: the checkpoint is of another config.
      InputRecordError: a bad record with `on_bad_record: raise`.
    """
    if jax.process_count() > 1:
        raise UsageError(
            "sparseflow predict runs in one process; start it without --num-processes."
        )
    batch = config.global_batch_size if options.batch_size is None else options.batch_size
    scoring = _with_global_batch(config, batch)
    mesh = _train.make_mesh(config.mesh.devices)
    specs = embedding.prepare_feature_specs_for_training(
        scoring.feature_specs, mesh.size, config.mesh.partitions_per_device
    )
    dense_model = _dense_model.dense_model(scoring, mesh, model_class=options.model)
    if not dense_model.per_example_logits:
        raise UsageError(
            "The model's outputs are not one logit per example, so there is no score per "
            "record to write; a retrieval model's item embeddings come from sparseflow export."
        )
    # The checkpoint is read as of the config's batch (its features' shapes are part of
    # the run's identity); the dense state's shapes do not depend on the batch.
    snapshot = restore(config, mesh, dense_model, options.checkpoint_dir)
    specs = _limits_of(snapshot, config, specs)
    reader = pipelines.ArrayRecordReader(pipelines.list_record_files(options.data))
    scorer = _Scorer(scoring, mesh, dense_model, snapshot.arrays, specs)
    train_options = _train.TrainOptions(data=options.data, fdo_dir=options.fdo_dir)
    scored = _score_all(scoring, train_options, mesh, reader, scorer, options.progress)
    if scored.bad_records:
        _log.warning("%d bad records were skipped and have no score.", len(scored.bad_records))
    kept = _kept_values(reader, options.keep)
    return Predictions(snapshot.step, *scored, kept=kept)


def _with_global_batch(config: RunConfig, batch: int) -> RunConfig:
    """`config` with global batch `batch`: its features' shapes too.

    Raises:
      UsageError: `batch` is not a positive multiple of devices x partitions_per_device.
    """
    partitions = config.mesh.num_partitions
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1 or batch % partitions:
        raise UsageError(
            f"The prediction batch size must be a positive multiple of devices x "
            f"partitions_per_device = {partitions} (every partition slot takes an equal "
            f"share), got {batch!r}."
        )
    if batch == config.global_batch_size:
        return config
    specs = {
        name: dataclasses.replace(
            spec,
            input_shape=(batch, *spec.input_shape[1:]),
            output_shape=(batch, *spec.output_shape[1:]),
        )
        for name, spec in config.feature_specs.items()
    }
    return dataclasses.replace(config, global_batch_size=batch, feature_specs=specs)


def restore(config: RunConfig, mesh: Mesh, dense_model: Any, directory: Path) -> Snapshot:
    """The newest readable checkpoint of `config`'s run in `directory`, its arrays
    `{"state": TrainState, "tables": {stack: EmbeddingVariables}}` laid out for `mesh`.

    Raises:
      UsageError: `directory` holds no checkpoint.
      CheckpointMismatchError: it is of another config.
      CheckpointError: none reads.
    """
    directory = Path(directory)
    if not directory.is_dir() or not any(p.name.isdigit() for p in directory.iterdir()):
        raise UsageError(f"{directory} holds no checkpoint; give the --checkpoint-dir of a run.")
    checkpoints = Checkpoints(directory, run=None, read_only=True)
    try:
        read_as = _mesh_change.from_any_mesh(config, _Reader(config, mesh, dense_model))
        return checkpoints.restore_latest(None, read_as=reading_dict_params(read_as, None))
    finally:
        checkpoints.close()


class _Reader:
    """Reads the dense state and the tables of a checkpoint of `config`'s run, written on
    any mesh, onto `mesh`."""

    def __init__(self, config: RunConfig, mesh: Mesh, dense_model: Any):
        self._config, self._mesh = config, mesh
        self._state = _train.abstract_dense_state(
            config, dense_model, NamedSharding(mesh, PartitionSpec())
        )

    def __call__(self, written: RunConfig, metadata: dict) -> Reading:
        """How to read a checkpoint of `written` (this run's config on its mesh)."""
        run = metadata["run"]
        layout = _run_identity.layout_identity(
            written, pipelined=run.get("pipelined"), processes=run["mesh"]["processes"]
        )
        # What shapes the arrays and their meaning must be the config's; the
        # input (data, order, preprocessing, batch) may differ.
        expected = dict(run, **{key: layout[key] for key in _MODEL_IDENTITY})
        like = {"state": self._state, "tables": _mesh_change.saved_tables(written, self._mesh)}
        return Reading(
            expected, like, lambda snapshot: self._relaid(snapshot, written), partial=True
        )

    def _relaid(self, snapshot: Snapshot, written: RunConfig) -> Snapshot:
        if _mesh_change.written_here(snapshot.metadata, self._config):
            return snapshot
        tables = _mesh_change.relaid_tables(
            snapshot.arrays["tables"], written, self._config, self._mesh
        )
        return snapshot._replace(arrays=dict(snapshot.arrays, tables=tables))


def _limits_of(snapshot: Snapshot, config: RunConfig, specs) -> Any:
    """`specs` with the limits the checkpoint's run ended with, if it ran on this mesh.

    A larger prediction batch raises them on its first batch, to what that
    batch needs with the config's headroom: measured on the demo config at
    twice its batch, that scored twice as fast as limits scaled up front by
    the batches' ratio (docs/benchmarks.md), whose larger buffers every
    forward pays for.
    """
    if not _mesh_change.written_here(snapshot.metadata, config):
        return specs
    limits = snapshot.metadata.get("limits")
    return _limit_feedback.specs_with_metadata(specs, _train.fdo_geometry(config), limits)


class _Scorer:
    """The trainer's evaluation forward on the restored arrays, for batches laid out
    under given specs (a program per specs, compiled on first use)."""

    def __init__(self, config: RunConfig, mesh: Mesh, dense_model: Any, arrays: dict, specs):
        self._config, self._mesh, self._dense_model = config, mesh, dense_model
        self._params, self._tables = arrays["state"].params, arrays["tables"]
        self.specs = specs
        self._stages = _train.stages(config, specs, mesh, dense_model)

    def __call__(self, batch: pipelines.DeviceBatch, specs) -> jax.Array:
        """`float32[global_batch]` scores of `batch`, laid out under `specs`, dispatched
        (not waited for)."""
        if specs is not self.specs:
            self.specs = specs
            self._stages = _train.stages(self._config, specs, self._mesh, self._dense_model)
        return self._stages.eval_logits(
            self._params, self._tables, batch.sparse, DenseInputs(batch.dense, batch.labels)
        )


class _Rows(NamedTuple):
    """The scored rows of a batch: the first `records.size` rows, in order.

    Attributes:
      records: `int64[k]` their dataset indices.
      labels: `int32[k]` their labels, -1 where the record has none.
    """

    records: np.ndarray
    labels: np.ndarray


class _Parsed(NamedTuple):
    batch: pipelines.ParsedBatch
    rows: _Rows


class _BatchParser:
    """Global batch `n` of the prediction: the records `n * B ..` in file order, parsed.

    Bad records are left out (or raise, per `on_bad_record`), and the batch is
    padded to `B` rows with copies of its last good record. A record without
    a label is given one (a `0` merged into its Example) so that it parses,
    and is marked as having none. The position of the batches drawn
    (`next_batch`) and the rows of every batch laid out (`rows`) live here,
    shared by the `_Batches` of successive limits.
    """

    def __init__(self, config: RunConfig, layout: pipelines.FeatureLayout, reader):
        self._layout, self._reader = layout, reader
        self._size = config.global_batch_size
        self._policy = pipelines.BadRecordPolicy(config.preprocessing.on_bad_record)
        label = layout.schema.label
        self._missing_label = f"missing feature {label.key!r}"
        self._label_suffix = _label_example(label)
        self._cached: tuple[int, _Parsed | None] | None = None
        self.num_batches = -(-reader.files.num_records // self._size)
        self.next_batch = 0
        self.rows: dict[int, _Rows] = {}
        self.bad_records: set[int] = set()

    def parsed(self, number: int) -> _Parsed | None:
        """Batch `number`, parsed and padded; None when all its records are bad."""
        if self._cached is None or self._cached[0] != number:
            self._cached = (number, self._parse(number))
        return self._cached[1]

    def _parse(self, number: int) -> _Parsed | None:
        first = number * self._size
        indices = np.arange(first, min(first + self._size, self._reader.files.num_records))
        padding = self._size - indices.size
        records = self._reader.read(np.pad(indices, (0, padding), mode="edge"))
        batch, problems = pipelines.parse_examples_lenient(records, self._layout)
        if not problems:
            return _Parsed(batch, _Rows(indices, batch.labels[: indices.size]))
        # The padding copies the last record: its problems are that record's.
        own = [(row, reason) for row, reason in problems if row < indices.size]
        return self._parse_slowly(indices, records[: indices.size], own)

    def _parse_slowly(
        self, indices: np.ndarray, records: list[bytes], problems: list[tuple[int, str]]
    ) -> _Parsed | None:
        unlabelled = {row for row, reason in problems if reason == self._missing_label}
        if unlabelled:
            records = [
                r + self._label_suffix if i in unlabelled else r for i, r in enumerate(records)
            ]
            _, problems = pipelines.parse_examples_lenient(records, self._layout)
        bad = self._bad_rows(problems, indices)
        good = [row for row in range(len(records)) if row not in bad]
        if not good:
            return None
        padded = [records[row] for row in good] + [records[good[-1]]] * (self._size - len(good))
        batch = pipelines.parse_examples(padded, self._layout)
        labels = np.where([row in unlabelled for row in good], -1, batch.labels[: len(good)])
        return _Parsed(batch, _Rows(indices[good], labels.astype(np.int32)))

    def _bad_rows(self, problems: list[tuple[int, str]], indices: np.ndarray) -> set[int]:
        """The rows of `problems`, logged; raises on the first with the "raise" policy."""
        for row, reason in problems:
            where = self._reader.files.describe(int(indices[row]))
            if self._policy is pipelines.BadRecordPolicy.RAISE:
                raise pipelines.InputRecordError(
                    f"{where} is bad: {reason}. Repair or remove it, or set "
                    "preprocessing.on_bad_record: skip to score the other records."
                )
            _log.warning("Skipping %s: %s", where, reason)
            self.bad_records.add(int(indices[row]))
        return {row for row, _ in problems}

    def stats(self, preprocess: pipelines.PreprocessConfig, number: int):
        """What batch `number` needs of each table's limits, every id counted."""
        counting = dataclasses.replace(
            preprocess, allow_id_dropping=True, enable_minibatching=False
        )
        parsed = self.parsed(number)
        return pipelines.PreprocessStage(counting).lay_out(number, parsed.batch, where="").stats


class _Batches:
    """The batches from `parser.next_batch` on, laid out under `preprocess`'s specs, on the
    devices (a `pipelines.DeviceIterator` as `FeedbackIterator` draws it)."""

    def __init__(self, parser: _BatchParser, preprocess: pipelines.PreprocessConfig, mesh: Mesh):
        self._parser, self._mesh = parser, mesh
        self._stage = pipelines.PreprocessStage(preprocess)
        self.num_batches = parser.num_batches

    def __next__(self) -> pipelines.DeviceBatch:
        parser = self._parser
        while parser.next_batch < self.num_batches:
            number = parser.next_batch
            parsed = parser.parsed(number)
            if parsed is not None:
                break
            parser.next_batch += 1
        else:
            raise StopIteration
        laid_out = self._stage.lay_out(number, parsed.batch, where=f"batch {number}")
        report = laid_out.report(
            records=0, bad_records=0, read_s=0.0, parse_s=0.0, preprocess_s=0.0
        )
        host = pipelines.HostBatch(
            number, laid_out.sparse, parsed.batch.dense, parsed.batch.labels, report
        )
        parser.rows[number] = parsed.rows
        parser.next_batch += 1
        return pipelines.to_device_batch(host, self._mesh)

    def get_state(self) -> bytes:
        return str(self._parser.next_batch).encode()

    def set_state(self, state: bytes) -> None:
        if int(state) != self._parser.next_batch:
            raise ValueError(f"The batches go on from {self._parser.next_batch}, not {state}.")

    def close(self) -> None:
        self._stage.close()


def _preprocess_config(config, options, mesh: Mesh, specs) -> pipelines.PreprocessConfig:
    """The trainer's preprocessing of `config`'s batches, never dropping an id."""
    layout = _train.record_layout(config, options)
    pre = config.preprocessing
    return pipelines.PreprocessConfig(
        feature_specs=specs,
        layout=layout,
        local_device_count=mesh.local_mesh.size,
        global_device_count=mesh.size,
        num_sc_per_device=config.mesh.partitions_per_device,
        allow_id_dropping=False,
        enable_minibatching=pre.enable_minibatching,
        invalid_id_policy=pre.invalid_id_policy,
        on_bad_record=pre.on_bad_record,
    )


class _Scored(NamedTuple):
    scores: np.ndarray
    labels: np.ndarray
    bad_records: list[int]
    examples_per_s: float


class _Clock:
    """Records scored per second after the first batch (whose time is mostly compiling)."""

    def __init__(self):
        self._first: float | None = None
        self._records = 0

    def scored(self, records: int) -> None:
        if self._first is None:
            self._first = time.perf_counter()
        else:
            self._records += records
            self._last = time.perf_counter()

    def examples_per_s(self) -> float:
        """NaN with fewer than two batches."""
        if not self._records:
            return float("nan")
        return self._records / (self._last - self._first)


def _score_all(config, options, mesh, reader, scorer: _Scorer, progress: bool) -> _Scored:
    """Every record's score and label, batch by batch.

    A helper thread lays out the next batch while the devices run the
    forward of the current one: the host's parsing and layout run beside the
    forward, as a Grain worker runs beside training. A forward is dispatched
    only once the previous one's scores are in: on several devices it has
    collectives, and XLA:CPU can deadlock on two such programs in flight.
    """
    total = reader.files.num_records
    scores = np.full(total, np.nan, np.float32)
    labels = np.full(total, -1, np.int32)
    preprocess = _preprocess_config(config, options, mesh, scorer.specs)
    parser = _BatchParser(config, preprocess.layout, reader)
    batches = _limit_feedback.FeedbackIterator(
        lambda new: _Batches(parser, dataclasses.replace(preprocess, feature_specs=new), mesh),
        scorer.specs,
        batch_stats=lambda new, number: parser.stats(
            dataclasses.replace(preprocess, feature_specs=new), number
        ),
        # The specs travel with each batch (`_drawn`) to the forward that scores it.
        on_new_specs=lambda new: None,
        geometry=_train.fdo_geometry(config),
        headroom=config.training.fdo_headroom,
        record=None,
    )
    bar = tqdm.tqdm(total=total, unit="record", disable=None if progress else True)
    pending, clock = None, _Clock()
    with batches, concurrent.futures.ThreadPoolExecutor(1) as helper:
        drawn = helper.submit(_drawn, batches, parser)
        while True:
            current, drawn = drawn.result(), None
            if current is not None:
                drawn = helper.submit(_drawn, batches, parser)
            if pending is not None:
                out, rows = pending
                scores[rows.records] = np.asarray(out)[: rows.records.size]
                labels[rows.records] = rows.labels
                bar.update(rows.records.size)
                clock.scored(rows.records.size)
            if current is None:
                break
            batch, rows, specs = current
            pending = (scorer(batch, specs), rows)
    bar.close()
    return _Scored(scores, labels, sorted(parser.bad_records), clock.examples_per_s())


def _drawn(batches: _limit_feedback.FeedbackIterator, parser: _BatchParser):
    """`(batch, its _Rows, the specs it is laid out under)`, or None after the last."""
    batch = next(batches, None)
    if batch is None:
        return None
    return batch, parser.rows.pop(batch.batch_number), batches.specs


def _label_example(label: pipelines.LabelColumn) -> bytes:
    """A serialized `tf.train.Example` holding only `label` = 0: appended to a record
    without a label, protobuf's merge of repeated messages adds it to the record's.

    Written out by hand: `tf.train.Example` would import TensorFlow (seconds)
    for these few bytes, which the tests check against its serialization."""
    if label.type is pipelines.ValueType.FLOAT:
        values = _field(2, _field(1, struct.pack("<f", 0.0)))  # FloatList, packed
    else:
        values = _field(3, _field(1, b"\x00"))  # Int64List, packed varint 0
    entry = _field(1, label.key.encode()) + _field(2, values)
    return _field(1, _field(1, entry))  # Example.features.feature[key]


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _kept_values(reader, keys: Sequence[str]) -> dict[str, list]:
    """Each record's values of `keys`: a scalar for one value, a list for several, None when
    absent (bytes as UTF-8 text)."""
    if not keys:
        return {}
    # TensorFlow only for this: its import takes seconds.
    example = importlib.import_module("tensorflow").train.Example
    kept = {key: [] for key in keys}
    total = reader.files.num_records
    for start in range(0, total, 4096):
        for record in reader.read(np.arange(start, min(start + 4096, total))):
            features = _features(example, record)
            for key in keys:
                kept[key].append(_value(features.get(key)))
    return kept


def _features(example, record: bytes) -> dict:
    try:
        return dict(example.FromString(record).features.feature)
    except Exception:  # noqa: BLE001 - a record that is no Example keeps no values
        return {}


def _value(feature) -> Any:
    kind = None if feature is None else feature.WhichOneof("kind")
    if kind is None:
        return None
    values = list(getattr(feature, kind).value)
    if kind == "bytes_list":
        values = [v.decode("utf-8", "backslashreplace") for v in values]
    if not values:
        return None
    return values[0] if len(values) == 1 else values
