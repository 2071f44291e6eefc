"""A small run, its datasets, and a plain-loop reference of the FDO stats.

The run: `user` reads `users`; `item` and `history` (weighted) share `items`;
`query` and `ad` read `queries` and `ads`, which are stacked into one physical
table. 4 devices x 2 partitions (N = 8), global batch 32.

`reference_stats` recomputes everything the FDO job reports the slow, obvious
way: every record parsed on its own, good records batched in a Python list,
every host's records parsed and preprocessed by the online code with the
run's own specs, and the summaries taken with numpy and `collections.Counter`.
"""

from __future__ import annotations

import collections
import json
import os

import numpy as np
import tensorflow as tf
from array_record.python import array_record_module

import beam_jobs
import embedding
import pipelines
from embedding import initializers

BATCH = 32
DEVICES = 4
PARTITIONS_PER_DEVICE = 2
CONFIG_HASH = "0123456789abcdef" * 4
_FIELDS = ("max_ids_per_partition", "max_unique_ids_per_partition", "required_buffer_size_per_sc")
VOCABULARY = {"users": 500, "items": 300, "queries": 200, "ads": 150}
FEATURE_TABLES = {
    "user": "users",
    "item": "items",
    "history": "items",
    "query": "queries",
    "ad": "ads",
}

DATASET = pipelines.SyntheticDataset(
    features=(
        pipelines.SyntheticFeature(
            name="user", vocabulary_size=500, min_valency=1, max_valency=1, zipf_exponent=1.3
        ),
        pipelines.SyntheticFeature(
            name="item", vocabulary_size=300, min_valency=1, max_valency=1, zipf_exponent=1.2
        ),
        pipelines.SyntheticFeature(
            name="history",
            vocabulary_size=300,
            min_valency=1,
            max_valency=6,
            zipf_exponent=1.2,
            weighted=True,
        ),
        pipelines.SyntheticFeature(
            name="query", vocabulary_size=200, min_valency=1, max_valency=4, zipf_exponent=1.1
        ),
        pipelines.SyntheticFeature(
            name="ad", vocabulary_size=150, min_valency=1, max_valency=2, zipf_exponent=1.5
        ),
    ),
    num_dense_features=2,
)
LAYOUT = DATASET.feature_layout()


def _table(name: str, combiner: str) -> embedding.TableSpec:
    return embedding.TableSpec(
        name=name,
        vocabulary_size=VOCABULARY[name],
        embedding_dim=8,
        initializer=initializers.Constant(0.0),
        optimizer=embedding.SGDOptimizerSpec(learning_rate=0.1),
        combiner=combiner,
        max_ids_per_partition=64,
        max_unique_ids_per_partition=64,
    )


def feature_specs() -> dict[str, embedding.FeatureSpec]:
    """The run's specs, with `queries` and `ads` stacked (as a config would)."""
    tables = {
        "users": _table("users", "sum"),
        "items": _table("items", "mean"),
        "queries": _table("queries", "sum"),
        "ads": _table("ads", "sum"),
    }
    specs = {
        name: embedding.FeatureSpec(
            name=name,
            table_spec=tables[table],
            input_shape=[BATCH, 1],
            output_shape=[BATCH, 8],
        )
        for name, table in FEATURE_TABLES.items()
    }
    return embedding.stack_tables(specs, ["queries", "ads"], DEVICES, PARTITIONS_PER_DEVICE)


def geometry(processes: int = 1) -> embedding.FdoGeometry:
    return embedding.FdoGeometry(
        global_batch_size=BATCH,
        devices=DEVICES,
        partitions_per_device=PARTITIONS_PER_DEVICE,
        processes=processes,
    )


def job_config(processes: int = 1, records_per_range: int = 1000, top_k: int = 5):
    return beam_jobs.FdoJobConfig(
        feature_specs=feature_specs(),
        layout=LAYOUT,
        geometry=geometry(processes),
        config_hash=CONFIG_HASH,
        top_k=top_k,
        records_per_range=records_per_range,
    )


def _int64s(*values) -> tf.train.Feature:
    return tf.train.Feature(int64_list=tf.train.Int64List(value=values))


def _floats(*values) -> tf.train.Feature:
    return tf.train.Feature(float_list=tf.train.FloatList(value=values))


def example(row: int, **overrides) -> bytes:
    """A good record whose ids depend on `row`; `overrides` replace (None: remove) keys."""
    history = [row % 7, (3 * row) % 300, (row * row) % 11][: 1 + row % 3]
    features = {
        "user": _int64s(row % 41),
        "item": _int64s((5 * row) % 13),
        "history": _int64s(*history),
        "history_weights": _floats(*[0.5 + (row % 4) / 4] * len(history)),
        "query": _int64s(*[(row + k) % 9 for k in range(1 + row % 4)]),
        "ad": _int64s(row % 3, (row // 3) % 150),
        "dense": _floats(0.5, -1.0),
        "label": _int64s(row % 2),
    }
    for key, value in overrides.items():
        if value is None:
            del features[key]
        else:
            features[key] = value
    return tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString()


# Bad records of every kind, with a word their dead-letter reason must contain.
BAD_RECORDS = {
    "not an example": (b"\xff\x00 definitely not a protobuf", "tf.train.Example"),
    "missing feature": (example(0, query=None), "missing feature 'query'"),
    "wrong type": (example(0, user=_floats(1.0)), "'user'"),
    "id too large": (example(0, item=_int64s(300)), "outside the vocabulary"),
    "negative id": (example(0, ad=_int64s(-1)), "outside the vocabulary"),
    "nan weight": (example(0, history_weights=_floats(float("nan"))), "weight"),
    "bad label": (example(0, label=_int64s(7)), "'label'"),
}


def write_records(path: str, records: list[bytes]) -> str:
    """Writes records to an ArrayRecord or TFRecord file (by extension)."""
    if path.endswith(".array_record"):
        writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
        for record in records:
            writer.write(record)
        writer.close()
    else:
        with tf.io.TFRecordWriter(path) as writer:
            for record in records:
                writer.write(record)
    return path


def hand_made_files(directory: str, extension: str) -> tuple[list[str], list[tuple[str, int, str]]]:
    """Three files of good records with the bad ones sprinkled in.

    Returns:
      The files, and `(file, record index, kind)` of every bad record.
    """
    bad = list(BAD_RECORDS)
    files, bad_positions, row = [], [], 0
    for file_index, count in enumerate((45, 3, 70)):
        path = os.path.join(directory, f"part-{file_index}{extension}")
        records = []
        for index in range(count):
            if index % 9 == 4 and bad:
                kind = bad.pop()
                records.append(BAD_RECORDS[kind][0])
                bad_positions.append((path, index, kind))
            else:
                records.append(example(row))
                row += 1
        files.append(write_records(path, records))
    return files, bad_positions


def _record_problem(record: bytes, specs) -> str | None:
    try:
        parsed = pipelines.parse_examples([record], LAYOUT)
    except pipelines.BadRecordError as e:
        return e.reason
    for name, ragged in parsed.ids.items():
        vocabulary = specs[name].table_spec.vocabulary_size
        if any(not 0 <= i < vocabulary for i in ragged.values.tolist()):
            return "id outside the vocabulary"
    for ragged in parsed.weights.values():
        if any(not (np.isfinite(w) and w >= 0) for w in ragged.values.tolist()):
            return "bad weight"
    return None


def reference(files: list[str], config: beam_jobs.FdoJobConfig):
    """`(stats document as in the stats file, dead letters as (file, index))`."""
    specs = config.feature_specs
    good, dead = [], []
    for path in files:
        for index, record in enumerate(pipelines.read_records(path)):
            if _record_problem(record, specs) is None:
                good.append(record)
            else:
                dead.append((path, index))
    g = config.geometry
    batches = [good[b * BATCH : (b + 1) * BATCH] for b in range(len(good) // BATCH)]
    per_batch = [_batch_stats(batch, specs, g) for batch in batches]
    return _document(per_batch, batches, config), dead


def _batch_stats(records: list[bytes], specs, g: embedding.FdoGeometry) -> dict:
    """Per stack and field, `[hosts, ...]` stats of one batch."""
    rows = BATCH // g.processes
    hosts = []
    for h in range(g.processes):
        parsed = pipelines.parse_examples(records[h * rows : (h + 1) * rows], LAYOUT)
        _, stats = embedding.preprocess_sparse_dense_matmul_input(
            {name: parsed.ids[name] for name in specs},
            {name: parsed.weights.get(name) for name in specs},
            specs,
            local_device_count=g.local_devices,
            global_device_count=g.devices,
            num_sc_per_device=g.partitions_per_device,
            allow_id_dropping=True,
        )
        hosts.append(stats)
    return {
        stack: {field: np.stack([getattr(s, field)[stack] for s in hosts]) for field in _FIELDS}
        for stack in hosts[0].max_ids_per_partition
    }


def _document(per_batch: list[dict], batches: list[list[bytes]], config) -> dict:
    g = config.geometry
    stacks = {}
    for stack in per_batch[0]:
        entry = {
            field: np.max([b[stack][field] for b in per_batch], axis=(0, 1)).tolist()
            for field in _FIELDS
        }
        entry["batch_max_percentiles"] = {
            field: _percentiles([int(b[stack][field].max()) for b in per_batch])
            for field in _FIELDS
        }
        partition_maxima = [
            b[stack]["max_ids_per_partition"].reshape(-1, g.num_partitions).max(axis=0)
            for b in per_batch
        ]
        entry["partition_histogram"] = _histogram(partition_maxima, g.num_partitions)
        stacks[stack] = entry
    return {
        "format": "sparseflow.fdo_stats",
        "version": 1,
        "config_hash": config.config_hash,
        "geometry": {
            "global_batch_size": g.global_batch_size,
            "devices": g.devices,
            "partitions_per_device": g.partitions_per_device,
            "processes": g.processes,
        },
        "batches": len(per_batch),
        "stacks": stacks,
        "tables": _id_frequencies(batches, config.top_k),
    }


def _percentiles(values: list[int]) -> dict[str, int]:
    names = {"p50": 50, "p90": 90, "p99": 99, "p99.9": 99.9, "max": 100}
    return {name: int(np.percentile(values, q, method="inverted_cdf")) for name, q in names.items()}


def _histogram(maxima: list[np.ndarray], partitions: int) -> dict:
    counts = collections.defaultdict(lambda: [0] * partitions)
    for batch_maxima in maxima:
        for p, value in enumerate(batch_maxima.tolist()):
            counts[value][p] += 1
    values = sorted(counts)
    return {
        "values": values,
        "counts": [[counts[v][p] for v in values] for p in range(partitions)],
    }


def _id_frequencies(batches: list[list[bytes]], top_k: int) -> dict:
    counters = {table: collections.Counter() for table in VOCABULARY}
    for batch in batches:
        parsed = pipelines.parse_examples(batch, LAYOUT)
        for feature, table in FEATURE_TABLES.items():
            counters[table].update(parsed.ids[feature].values.tolist())
    return {
        table: {
            "ids": sum(counter.values()),
            "distinct_ids": len(counter),
            "top_ids": [
                [i, c] for i, c in sorted(counter.items(), key=lambda item: (-item[1], item[0]))
            ][:top_k],
        }
        for table, counter in counters.items()
    }


def document(stats: embedding.FdoStats) -> dict:
    """The stats as their file's JSON document (comparable with ==)."""
    return json.loads(stats.to_json())
