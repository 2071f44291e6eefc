"""The FDO job's PTransforms: they wire steps; the work is in the modules they call.

  record files -> ReadGlobalBatches -> ComputeBatchStats -> CombineFdoStats
                  (+ dead letters)                          -> WriteFdoStatsFile

ReadGlobalBatches forms training's batches when the job knows training's
order (`FdoJobConfig.training_order`): every record goes to its batch of
every epoch through one GroupByKey, keyed by groups of consecutive batches
(`_training_batches`). Otherwise it forms
the batches of the good records in file order: ranges cut at batch
boundaries, fragments joined (`_batches`), the batches within one range
folded into stats as the range is checked (`_range_stats`).

Counters (Beam metrics, namespace `METRICS_NAMESPACE`): `records` read,
`bad_records` sent to the dead letters, `tail_records` of the dropped last
partial batch, `batches` whose stats were computed.

Every step costs the in-process runner time at every run (building,
translating and running it), whatever the data: the job keeps them few.
Files and ranges are spread by plain GroupByKeys; what every worker needs
whole (the ranges, their checks, the accumulators to merge) it reads as a
side input, which adds no step; the per-batch stats are folded per bundle
before one step merges the accumulators (no output when there are none),
and dead letters are written in two steps.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import posixpath
import shutil
import uuid
from collections.abc import Iterable

import apache_beam as beam
import numpy as np
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from apache_beam.transforms.window import GlobalWindows

import embedding
from beam_jobs._batch_stats import BatchStatsComputer
from beam_jobs._batches import (
    RangeCheck,
    RangeOffsets,
    RecordRange,
    SparseRows,
    assumed_offsets,
    check_records,
    join_fragments,
    range_offsets,
    read_range,
    split_file,
)
from beam_jobs._dense_moments import DenseMomentsFn, by_key, moments_of
from beam_jobs._job_config import FdoJobConfig
from beam_jobs._range_stats import RangeStats, RangeStatsComputer, fdo_stats_fn
from beam_jobs._training_batches import (
    TrainingBatchPlan,
    batches_per_group,
    group_parts,
    join_group,
)

METRICS_NAMESPACE = "sparseflow.fdo"
_DEAD_LETTERS = "dead_letters"
BATCH_PARTS = ("batches", "joined_batches")
_FRAGMENTS = "fragments"
_MOMENTS = "dense_moments"
_RANGE_STATS = "range_stats"


class _CheckRecordsFn(beam.DoFn):
    """A range -> `(range key, RangeCheck)`; its bad records as dead letters.

    Given all `ranges` (file order), also the bundle's `RangeStats` under
    their `assumed_offsets`, at its end (`_RANGE_STATS`).
    """

    def __init__(self, config: FdoJobConfig):
        self._config = config
        self._moments = config.moments_schema is not None
        self._records = Metrics.counter(METRICS_NAMESPACE, "records")
        self._bad_records = Metrics.counter(METRICS_NAMESPACE, "bad_records")

    def setup(self):
        file_order = self._config.training_order is None
        self._range_stats = RangeStatsComputer(self._config) if file_order else None
        # Every bundle of a run sees the same ranges: numbered once.
        self._assumed = None

    def start_bundle(self):
        self._stats = None
        # The first range with a bad record, and the last range, of the bundle.
        self._first_bad = self._last = None

    def process(self, record_range: RecordRange, ranges: list[RecordRange] | None = None):
        records = read_range(record_range)
        c = self._config
        rows, problems = check_records(records, c.layout, c.vocabulary_sizes)
        self._records.inc(len(records))
        self._bad_records.inc(len(problems))
        for index, reason in problems:
            yield beam.pvalue.TaggedOutput(
                _DEAD_LETTERS,
                {
                    "file": record_range.path,
                    "record_index": record_range.start + index,
                    "reason": reason,
                },
            )
        if self._moments:
            yield beam.pvalue.TaggedOutput(_MOMENTS, moments_of(rows.dense))
        bad = np.array([index for index, _ in problems], np.int64)
        yield record_range.key, RangeCheck(len(records), bad)
        if ranges is not None:
            if self._assumed is None:
                self._assumed = assumed_offsets(ranges)
            self._add(record_range, rows, bool(problems), self._assumed)

    def _add(self, record_range: RecordRange, rows: SparseRows, bad: bool, assumed: RangeOffsets):
        key, computer = record_range.key, self._range_stats
        if bad and (self._first_bad is None or key < self._first_bad):
            self._first_bad = key
        if self._last is None or key > self._last:
            self._last = key
        stats = computer.empty() if self._stats is None else self._stats
        if self._first_bad is not None and self._first_bad < self._last:
            # A range after a bad record moves: the bundle's stats will not stand.
            self._stats = computer.without_stats(stats, record_range, rows.num_rows)
        else:
            self._stats = computer.add(stats, record_range, rows, assumed)

    def finish_bundle(self):
        if self._stats is not None:
            stats = self._range_stats.compact(self._stats)
            yield beam.pvalue.TaggedOutput(_RANGE_STATS, GlobalWindows.windowed_value(stats))
            self._stats = None


class _SettleRangesFn(beam.DoFn):
    """`RangeStats` under assumed offsets -> the stats under the true ones (`range_offsets`
    of the ranges' `checks`).

    Outputs the accumulator of the ranges' whole batches, and their fragments
    (`_FRAGMENTS`); ranges whose stats do not stand are read, checked and cut
    again, as many tasks as the checking pass had bundles.
    """

    def __init__(self, config: FdoJobConfig):
        self._config = config
        self._tail_records = Metrics.counter(METRICS_NAMESPACE, "tail_records")
        self._batches = Metrics.counter(METRICS_NAMESPACE, "batches")

    def setup(self):
        self._range_stats = RangeStatsComputer(self._config)
        # Every bundle of a run sees the same checks: numbered once.
        self._offsets = None

    def process(self, stats: RangeStats, checks: list[tuple[tuple[int, int], RangeCheck]]):
        c, computer = self._config, self._range_stats
        if self._offsets is None:
            self._offsets = range_offsets(checks)
        offsets = self._offsets
        if not computer.holds(stats, offsets):
            again = computer.empty()
            for record_range, _, _ in stats.ranges:
                rows, _ = check_records(read_range(record_range), c.layout, c.vocabulary_sizes)
                again = computer.add(again, record_range, rows, offsets)
            stats = computer.compact(again)
        self._tail_records.inc(computer.tail(stats, offsets))
        self._batches.inc(stats.batches)
        for fragment in stats.fragments:
            yield beam.pvalue.TaggedOutput(_FRAGMENTS, fragment)
        if stats.batches:
            yield stats.accumulator


class _PlaceRecordsFn(beam.DoFn):
    """A range -> `(group, (batches, sort keys, rows))`: its good records, sent to their
    batches' groups (`batches_per_group`)."""

    def __init__(self, config: FdoJobConfig):
        self._group_size = batches_per_group(
            config.records_per_range, config.geometry.global_batch_size
        )
        self._layout = config.layout
        self._vocabulary_sizes = config.vocabulary_sizes
        self._tail_records = Metrics.counter(METRICS_NAMESPACE, "tail_records")

    def process(self, record_range: RecordRange, plan: TrainingBatchPlan):
        records = read_range(record_range)
        rows, problems = check_records(records, self._layout, self._vocabulary_sizes)
        good = np.setdiff1d(np.arange(len(records)), [index for index, _ in problems])
        batches, keys, index, tail = plan.rows(good + plan.first_record[record_range.key])
        self._tail_records.inc(tail)
        yield from group_parts(rows, batches, keys, index, self._group_size)


def _split(records_per_range: int, indexed_files: Iterable[tuple[int, str]]) -> list[RecordRange]:
    return [r for file in indexed_files for r in split_file(*file, records_per_range)]


def _joined(batch_and_fragments: tuple[int, Iterable], batch_size: int):
    batch, fragments = batch_and_fragments
    return batch, join_fragments(batch, fragments, batch_size)


def _joined_group(group_and_parts: tuple[int, Iterable], batch_size: int):
    group, parts = group_and_parts
    return join_group(group, parts, batch_size)


class _Group(beam.PTransform):
    """Groups the elements by `key(element)`; outputs the elements of `then(group)`.

    A plain GroupByKey: Beam's `Reshuffle` (which also keeps timestamps and
    windows) or `ToList` (a combine) adds steps to every run.
    """

    def __init__(self, key, then):
        super().__init__()
        self._key = key
        self._then = then

    def expand(self, pcoll):
        return (
            pcoll
            | "Key" >> beam.Map(lambda element, key: (key(element), element), self._key)
            | "Group" >> beam.GroupByKey()
            | "Then" >> beam.FlatMap(lambda key_values, then: then(key_values[1]), self._then)
        )


def redistribute(key) -> _Group:
    """A fusion break that spreads the elements (few and small) over the workers, by `key`."""
    return _Group(key, _as_is)


def _gather(fn) -> _Group:
    """All elements -> one element, `fn(list of them)` (none from no elements)."""
    return _Group(_one_key, functools.partial(_applied, fn))


def _as_is(values):
    return values


def _one_key(_) -> None:
    return None


def _applied(fn, values) -> list:
    return [fn(list(values))]


class ReadGlobalBatches(beam.PTransform):
    """Record files -> `(batch number, SparseRows)` for every whole global batch (or its stats).

    See `beam_jobs._training_batches` (with a training order) and
    `beam_jobs._batches` (without) for which batches these are. The output
    is a dict: "dead_letters" (`{"file", "record_index", "reason"}` per bad
    record), "dense_moments" (`Moments` per range, with
    `config.moments_schema` only) and the batches in parts (`BATCH_PARTS`).
    With a training order, one part, "batches", and "batch_order" (one
    `embedding.FdoBatchOrder`). Without, "joined_batches" (joined from
    fragments of several ranges) and, for the batches within one range,
    their stats already: "whole_batch_stats", `FdoStatsFn` accumulators, one
    per bundle of ranges the records were checked in (`beam_jobs._range_stats`).
    """

    def __init__(self, files: list[str], config: FdoJobConfig):
        super().__init__()
        self._files = list(files)
        self._config = config

    def expand(self, pbegin):
        config = self._config
        ranges = self._ranges(pbegin)
        # The ranges and checks are few and small: side inputs, as lists, cost
        # the in-process runner no step of their own (a GroupByKey would).
        side_inputs = {}
        if config.training_order is None:
            side_inputs["ranges"] = beam.pvalue.AsList(ranges)
        checked = ranges | "CheckRecords" >> beam.ParDo(
            _CheckRecordsFn(config), **side_inputs
        ).with_outputs(_DEAD_LETTERS, _MOMENTS, _RANGE_STATS, main="checks")
        if config.training_order is not None:
            return self._training_batches(ranges, checked)
        settled = checked[_RANGE_STATS] | "SettleRanges" >> beam.ParDo(
            _SettleRangesFn(config), checks=beam.pvalue.AsList(checked.checks)
        ).with_outputs(_FRAGMENTS, main="whole")
        joined = (
            settled[_FRAGMENTS]
            | "GroupFragments" >> beam.GroupByKey()
            | "JoinFragments" >> beam.Map(_joined, config.geometry.global_batch_size)
        )
        return {
            "whole_batch_stats": settled.whole,
            "joined_batches": joined,
            "dead_letters": checked[_DEAD_LETTERS],
            "dense_moments": checked[_MOMENTS],
        }

    def _training_batches(self, ranges, checked):
        config = self._config
        plan = checked.checks | "PlanTrainingBatches" >> _gather(
            functools.partial(TrainingBatchPlan, config.training_order, config.geometry)
        )
        batches = (
            ranges
            | "PlaceRecords"
            >> beam.ParDo(_PlaceRecordsFn(config), plan=beam.pvalue.AsSingleton(plan))
            | "GroupRecords" >> beam.GroupByKey()
            | "JoinBatches" >> beam.FlatMap(_joined_group, config.geometry.global_batch_size)
        )
        return {
            "batches": batches,
            "dead_letters": checked[_DEAD_LETTERS],
            "dense_moments": checked[_MOMENTS],
            "batch_order": plan | "BatchOrder" >> beam.Map(lambda plan: plan.batch_order),
        }

    def _ranges(self, pbegin):
        config = self._config
        # Files, then ranges, are spread over the workers: counting the records
        # of a TFRecord file reads it. The files are split where they land.
        ranges = (
            pbegin
            | "Start" >> beam.Impulse()
            | "ListFiles" >> beam.FlatMap(lambda _, files: enumerate(files), self._files)
            | "SplitFiles"
            >> _Group(
                lambda indexed_file: indexed_file[0],
                functools.partial(_split, config.records_per_range),
            )
            | "DistributeRanges" >> redistribute(lambda record_range: record_range.key)
        )
        return ranges


class _BatchStatsFn(beam.DoFn):
    def __init__(self, config: FdoJobConfig):
        self._config = config
        self._batches = Metrics.counter(METRICS_NAMESPACE, "batches")

    def setup(self):
        self._compute = BatchStatsComputer(self._config.feature_specs, self._config.geometry)

    def process(self, batch_and_rows):
        self._batches.inc()
        yield self._compute(*batch_and_rows)


class ComputeBatchStats(beam.PTransform):
    """`(batch number, SparseRows)` -> `BatchStats`, through the online preprocessing."""

    def __init__(self, config: FdoJobConfig):
        super().__init__()
        self._config = config

    def expand(self, batches):
        return batches | "Preprocess" >> beam.ParDo(_BatchStatsFn(self._config))


class _AccumulateFn(beam.DoFn):
    """Folds a bundle's elements into one accumulator of `fn` (compacted), output at its end.

    What Beam's combiner lifting does, done before a Flatten: the runner
    then holds a few accumulators between stages, not every element.
    """

    def __init__(self, fn: beam.CombineFn):
        self._fn = fn

    def start_bundle(self):
        self._accumulator = None

    def process(self, element):
        if self._accumulator is None:
            self._accumulator = self._fn.create_accumulator()
        self._accumulator = self._fn.add_input(self._accumulator, element)

    def finish_bundle(self):
        if self._accumulator is not None:
            yield GlobalWindows.windowed_value(self._fn.compact(self._accumulator))
            self._accumulator = None


class CombineFdoStats(beam.PTransform):
    """`BatchStats` -> one `embedding.FdoStats`, none when there are no batches.

    The input is one PCollection, or a tuple of them (parts of the batches),
    or a dict of such: "batch_stats" (`BatchStats`) and "accumulators"
    (`FdoStatsFn` accumulators of batches folded already). Each part of
    `BatchStats` is folded per bundle into accumulators, and one step merges
    the few accumulators, read as side inputs: no Flatten and no GroupByKey,
    each of which would cost the in-process runner a step of its own.
    """

    def __init__(self, config: FdoJobConfig):
        super().__init__()
        self._config = config

    def expand(self, inputs):
        fn = fdo_stats_fn(self._config)
        if not isinstance(inputs, dict):
            inputs = {"batch_stats": inputs}
        accumulators = [
            part | f"Accumulate{i}" >> beam.ParDo(_AccumulateFn(fn))
            for i, part in enumerate(_parts(inputs.get("batch_stats", ())))
        ]
        accumulators += _parts(inputs.get("accumulators", ()))
        pipeline = accumulators[0].pipeline
        return (
            pipeline
            | "Start" >> beam.Impulse()
            | "Merge"
            >> beam.FlatMap(_merged, fn, *(beam.pvalue.AsList(part) for part in accumulators))
        )


def _merged(_, fn: beam.CombineFn, *accumulators: list) -> list:
    """`fn`'s output from lists of its accumulators; none from no accumulators.

    Merged into a new accumulator: a merge may change only its first
    accumulator, and side inputs' values may be shared with other readers.
    """
    merged = [accumulator for part in accumulators for accumulator in part]
    if not merged:
        return []
    return [fn.extract_output(fn.merge_accumulators([fn.create_accumulator(), *merged]))]


def _parts(pcolls) -> tuple:
    return pcolls if isinstance(pcolls, tuple) else (pcolls,)


class ComputeFdoStats(beam.PTransform):
    """Record files -> {"stats": one `embedding.FdoStats`, "dead_letters": dicts,
    "dense_moments": the moments file's content (with `config.moments_schema` only)}.

    Without `config.moments_schema`, there is no "dense_moments", nor its steps.
    """

    def __init__(self, files: list[str], config: FdoJobConfig):
        super().__init__()
        self._files = list(files)
        self._config = config

    def expand(self, pbegin):
        read = pbegin | "ReadGlobalBatches" >> ReadGlobalBatches(self._files, self._config)
        batch_stats = tuple(
            read[part] | f"ComputeBatchStats/{part}" >> ComputeBatchStats(self._config)
            for part in BATCH_PARTS
            if part in read
        )
        stats = {"batch_stats": batch_stats}
        if "whole_batch_stats" in read:
            stats["accumulators"] = read["whole_batch_stats"]
        stats = stats | "CombineFdoStats" >> CombineFdoStats(self._config)
        if "batch_order" in read:
            stats = stats | "WithBatchOrder" >> beam.Map(
                lambda stats, order: dataclasses.replace(stats, batch_order=order),
                beam.pvalue.AsSingleton(read["batch_order"]),
            )
        outputs = {"stats": stats, "dead_letters": read["dead_letters"]}
        if self._config.moments_schema is not None:
            outputs["dense_moments"] = (
                read["dense_moments"]
                | "CombineDenseMoments" >> beam.CombineGlobally(DenseMomentsFn()).without_defaults()
                | "DenseMomentsByKey" >> beam.Map(by_key, self._config.moments_schema)
            )
        return outputs


def _write_atomically(stats: embedding.FdoStats, path: str) -> None:
    """Writes a stats file through Beam's filesystems: a temporary file, then a rename."""
    if not stats.batches:
        return
    directory, name = posixpath.split(path)
    temp_path = FileSystems.join(directory, f".{name}.tmp")
    with FileSystems.create(temp_path) as file:
        file.write(stats.to_json().encode())
    FileSystems.rename([temp_path], [path])


def write_json(content: dict, path: str) -> None:
    """Writes `content` as JSON to `path` (any Beam filesystem)."""
    with FileSystems.create(path) as file:
        file.write(json.dumps(content, indent=1).encode())


class WriteFdoStatsFile(beam.PTransform):
    """Writes the stats to `path` (any Beam filesystem); nothing when no batch was seen."""

    def __init__(self, path: str):
        super().__init__()
        self._path = path

    def expand(self, stats):
        return stats | "Write" >> beam.Map(_write_atomically, self._path)


class _WriteShardFn(beam.DoFn):
    """Writes a bundle's dead letters to a new file in `directory`; outputs its path."""

    def __init__(self, directory: str):
        self._directory = directory

    def start_bundle(self):
        self._path, self._file = None, None

    def process(self, letter: dict):
        if self._file is None:
            self._path = FileSystems.join(self._directory, f"shard-{uuid.uuid4().hex}")
            self._file = FileSystems.create(self._path)
        self._file.write(json.dumps(letter, sort_keys=True).encode() + b"\n")

    def finish_bundle(self):
        if self._file is not None:
            self._file.close()
            yield GlobalWindows.windowed_value(self._path)
            self._path, self._file = None, None


def _concatenate(_, shards: list[str], path: str, directory: str) -> None:
    """Writes the shards, one after the other, to `path` (via a renamed temporary file)."""
    parent, name = posixpath.split(path)
    temp_path = FileSystems.join(parent, f".{name}.tmp")
    with FileSystems.create(temp_path) as file:
        for shard in shards:
            with FileSystems.open(shard) as lines:
                shutil.copyfileobj(lines, file)
    FileSystems.rename([temp_path], [path])
    # Shards of bundles a runner retried are in the directory but not in `shards`.
    written = FileSystems.match([FileSystems.join(directory, "shard-*")])[0].metadata_list
    if written:
        FileSystems.delete([metadata.path for metadata in written])
    if FileSystems.exists(directory):  # a local directory; object stores have none
        FileSystems.delete([directory])


class WriteDeadLetters(beam.PTransform):
    """Writes dead letters as one JSON object per line to `path` (always created).

    Every bundle writes its letters to a file of its own next to `path`, and
    one step then joins these files: the letters stream to files where they
    are found, and the few steps of a sharded `WriteToText` are saved.
    """

    def __init__(self, path: str):
        super().__init__()
        self._path = path

    def expand(self, dead_letters):
        parent, name = posixpath.split(self._path)
        directory = FileSystems.join(parent, f".{name}-{uuid.uuid4().hex}")
        shards = dead_letters | "WriteShards" >> beam.ParDo(_WriteShardFn(directory))
        return (
            dead_letters.pipeline
            | "Start" >> beam.Impulse()
            | "Join" >> beam.Map(_concatenate, beam.pvalue.AsList(shards), self._path, directory)
        )
