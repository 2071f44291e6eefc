"""`sparseflow stats`: records -> parsed batches -> the sharded layout, summarized.

One pass over a config's dataset (made first if missing): every global batch
is parsed and preprocessed for the config's whole mesh (in the single-process
run every device is local), and the stats of every stacked table are
summarized: the ids it sees, how close they come to its limits and buffer,
and what was dropped.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator, Sequence

import numpy as np
import tqdm

import embedding
import pipelines
from sparseflow._datasets import checked_manifest
from sparseflow._id_coverage import FeatureCoverage, IdCoverage, format_coverage
from sparseflow._text_table import aligned_table
from sparseflow.config._run_config import RunConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class StackSummary:
    """What one stacked table saw over the batches.

    Attributes:
      name: the stack (physical table).
      features: the features it serves.
      ids_per_batch: mean ids per global batch, before merging.
      max_ids_per_partition: max over batches, devices and partitions.
      max_ids_limit: the stack's `max_ids_per_partition`.
      max_unique_ids_per_partition: max over batches, devices and partitions.
      max_unique_ids_limit: the stack's `max_unique_ids_per_partition`.
      required_buffer_per_slot: max over batches and slots of the entries a
        slot needs (each partition's count rounded up to 8).
      buffer_per_slot: entries a slot owns in the device buffer.
      drops: ids dropped by limits or buffer, over all batches.
      invalid_ids: out-of-range ids dropped, over all batches.
    """

    name: str
    features: tuple[str, ...]
    ids_per_batch: float
    max_ids_per_partition: int
    max_ids_limit: int
    max_unique_ids_per_partition: int
    max_unique_ids_limit: int
    required_buffer_per_slot: int
    buffer_per_slot: int
    drops: int
    invalid_ids: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class StatsReport:
    """Totals of one pass over a dataset.

    Attributes:
      batches: global batches preprocessed.
      examples: examples in them.
      ids: sparse ids in them.
      parse_seconds: time spent parsing records.
      preprocess_seconds: time spent in `preprocess_sparse_dense_matmul_input`.
      stacks: one summary per stacked table.
      features: per feature, its distinct ids and how many are out of
        vocabulary or collide under hashing.
    """

    batches: int
    examples: int
    ids: int
    parse_seconds: float
    preprocess_seconds: float
    stacks: tuple[StackSummary, ...]
    features: tuple[FeatureCoverage, ...] = ()


def _global_batches(
    records: Iterator[bytes], size: int, limit: int | None
) -> Iterator[list[bytes]]:
    """Consecutive full batches of `size` records, at most `limit` of them (None: all)."""
    for _ in itertools.count() if limit is None else range(limit):
        batch = list(itertools.islice(records, size))
        if len(batch) < size:
            return
        yield batch


def _weights(parsed: pipelines.ParsedBatch, names: Sequence[str]):
    """The weights pytree for the preprocessing: None when no feature is weighted.

    The weights must mirror the features exactly, so once one feature is
    weighted every other one gets weight 1 per id.
    """
    if not parsed.weights:
        return None
    return {
        name: parsed.weights[name] if name in parsed.weights else _unit_weights(parsed.ids[name])
        for name in names
    }


def _unit_weights(ids: embedding.RaggedIds) -> embedding.RaggedIds:
    return embedding.RaggedIds(np.ones(ids.values.size, np.float32), ids.row_splits)


def _preprocess(config: RunConfig, parsed: pipelines.ParsedBatch):
    names = list(config.feature_specs)
    devices = config.mesh.devices
    _, stats = embedding.preprocess_sparse_dense_matmul_input(
        {name: parsed.ids[name] for name in names},
        _weights(parsed, names),
        config.feature_specs,
        local_device_count=devices,
        global_device_count=devices,
        num_sc_per_device=config.mesh.partitions_per_device,
        allow_id_dropping=config.preprocessing.allow_id_dropping,
        invalid_id_policy=config.preprocessing.invalid_id_policy,
    )
    return stats


def _stack_features(config: RunConfig) -> dict[str, tuple[embedding.StackedTableSpec, list[str]]]:
    """Per stack name: its spec and its features, in config order."""
    prepared = embedding.prepare_feature_specs_for_training(
        config.feature_specs, config.mesh.devices, config.mesh.partitions_per_device
    )
    stacks: dict[str, tuple[embedding.StackedTableSpec, list[str]]] = {}
    for name in config.feature_specs:
        stacked = prepared[name].table_spec.stacked_table_spec
        stacks.setdefault(stacked.stack_name, (stacked, []))[1].append(name)
    return stacks


def _summaries(
    config: RunConfig,
    stats: Sequence[embedding.SparseDenseMatmulInputStats],
    ids_per_feature: dict[str, int],
) -> tuple[StackSummary, ...]:
    mesh = config.mesh
    summaries = []
    for name, (stacked, features) in _stack_features(config).items():
        buffer = embedding.coo_buffer_size_per_device(
            stacked.max_ids_per_partition,
            stacked.suggested_coo_buffer_size_per_device,
            mesh.partitions_per_device,
            mesh.num_partitions,
        )
        summaries.append(
            StackSummary(
                name=name,
                features=tuple(features),
                ids_per_batch=sum(ids_per_feature[f] for f in features) / len(stats),
                max_ids_per_partition=max(int(s.max_ids_per_partition[name].max()) for s in stats),
                max_ids_limit=stacked.max_ids_per_partition,
                max_unique_ids_per_partition=max(
                    int(s.max_unique_ids_per_partition[name].max()) for s in stats
                ),
                max_unique_ids_limit=stacked.max_unique_ids_per_partition,
                required_buffer_per_slot=max(
                    int(s.required_buffer_size_per_sc[name].max()) for s in stats
                ),
                buffer_per_slot=buffer // mesh.partitions_per_device,
                drops=sum(int(s.id_drop_counters[name]) for s in stats),
                invalid_ids=sum(int(s.invalid_id_counters[name]) for s in stats),
            )
        )
    return tuple(summaries)


def run_stats(config: RunConfig, *, max_batches: int | None = None) -> StatsReport:
    """Parses and preprocesses the config's dataset, one global batch at a time.

    Args:
      config: the run; its dataset must exist (`dataset.train`, or `make_dataset`).
      max_batches: stop after this many batches (default: one pass).

    Returns:
      The totals and the per-stack summaries.

    Raises:
      DataError: the dataset does not match the config or holds less than
        one global batch; a record is bad (`pipelines.BadRecordError`); a
        batch breaks a limit with dropping off, or holds an invalid id with
        the "raise" policy.
    """
    batch_size = config.global_batch_size
    if config.dataset.train is None:
        manifest = checked_manifest(config)
        available = manifest["num_examples"] // batch_size
        if not available:
            raise pipelines.DataError(
                f"The dataset in {config.dataset.dir} holds {manifest['num_examples']} "
                f"examples, less than one global batch of {batch_size}."
            )
        num_batches = available if max_batches is None else min(max_batches, available)
    else:
        num_batches = max_batches
    files = pipelines.list_record_files(list(config.dataset.train_data))
    layout = config.layout
    coverage = IdCoverage(
        layout, {name: f.table_spec.vocabulary_size for name, f in config.feature_specs.items()}
    )
    stats, ids_per_feature = [], dict.fromkeys(config.feature_specs, 0)
    parse_seconds = preprocess_seconds = 0.0
    batches = _global_batches(pipelines.read_records(files), batch_size, num_batches)
    for records in tqdm.tqdm(batches, total=num_batches, unit="batch", disable=None):
        start = time.perf_counter()
        parsed = pipelines.parse_examples(records, layout)
        middle = time.perf_counter()
        stats.append(_preprocess(config, parsed))
        preprocess_seconds += time.perf_counter() - middle
        parse_seconds += middle - start
        for name in ids_per_feature:
            ids_per_feature[name] += parsed.ids[name].values.size
        wide = coverage.wide_layout and pipelines.parse_examples(records, coverage.wide_layout)
        coverage.add(parsed, wide)
    if not stats:
        raise ValueError(
            f"The records of {', '.join(config.dataset.train_data)} hold less than one "
            f"global batch of {batch_size}."
        )
    return StatsReport(
        batches=len(stats),
        examples=len(stats) * batch_size,
        ids=sum(ids_per_feature.values()),
        parse_seconds=parse_seconds,
        preprocess_seconds=preprocess_seconds,
        stacks=_summaries(config, stats, ids_per_feature),
        features=coverage.summaries(),
    )


_COLUMNS = (
    ("stack", "<"),
    ("features", "<"),
    ("ids/batch", ">"),
    ("max ids/part", ">"),
    ("max unique/part", ">"),
    ("buffer/slot", ">"),
    ("drops", ">"),
    ("invalid", ">"),
)


def _row(stack: StackSummary) -> tuple[str, ...]:
    return (
        stack.name,
        ", ".join(stack.features),
        f"{stack.ids_per_batch:,.0f}",
        f"{stack.max_ids_per_partition} / {stack.max_ids_limit}",
        f"{stack.max_unique_ids_per_partition} / {stack.max_unique_ids_limit}",
        f"{stack.required_buffer_per_slot} / {stack.buffer_per_slot}",
        f"{stack.drops:,}",
        f"{stack.invalid_ids:,}",
    )


def format_report(result: StatsReport) -> str:
    """The per-stack and per-feature summaries as aligned text tables, with the throughput."""
    rows = [tuple(name for name, _ in _COLUMNS), *map(_row, result.stacks)]
    lines = aligned_table(rows, [align for _, align in _COLUMNS])
    preprocess_rate = result.ids / result.preprocess_seconds if result.preprocess_seconds else 0.0
    parse_rate = result.examples / result.parse_seconds if result.parse_seconds else 0.0
    lines += [
        "",
        "limits: max ids/part and max unique/part show the batch maximum / the table's limit;",
        "buffer/slot shows the entries a partition slot needed / the entries it owns.",
        "",
        *format_coverage(result.features),
        "",
        "distinct: ids (hashed: strings) seen; out of vocab: distinct ids outside the table;",
        "hash collisions: distinct strings sharing a table row with another.",
        f"{result.batches} batches, {result.examples:,} examples, {result.ids:,} ids; "
        f"parsing {parse_rate:,.0f} examples/s; preprocessing {preprocess_rate:,.0f} ids/s "
        f"({1000 * result.preprocess_seconds / max(result.batches, 1):.1f} ms/batch).",
    ]
    return "\n".join(lines)
