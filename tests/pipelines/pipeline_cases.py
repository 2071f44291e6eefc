"""Small datasets, specs and comparisons shared by the pipeline tests and their subprocesses.

A tiny recommender input: feature `a` reads table `t1`; features `b`
(weighted) and `c` share table `t2`. Batches are compared as flat dicts of
numpy arrays.
"""

from __future__ import annotations

import os
import socket

import numpy as np
import tensorflow as tf

import embedding
import pipelines
from embedding import initializers
from pipelines._records import RecordFileWriter

DATASET = pipelines.SyntheticDataset(
    features=(
        pipelines.SyntheticFeature(
            name="a", vocabulary_size=64, min_valency=1, max_valency=3, zipf_exponent=1.2
        ),
        pipelines.SyntheticFeature(
            name="b",
            vocabulary_size=32,
            min_valency=1,
            max_valency=2,
            zipf_exponent=1.5,
            weighted=True,
        ),
        pipelines.SyntheticFeature(
            name="c", vocabulary_size=32, min_valency=1, max_valency=1, zipf_exponent=2.0
        ),
    ),
    num_dense_features=3,
)
LAYOUT = DATASET.feature_layout()


def table(name: str, vocabulary_size: int, *, limit: int = 256, combiner: str = "sum"):
    return embedding.TableSpec(
        name=name,
        vocabulary_size=vocabulary_size,
        embedding_dim=8,
        initializer=initializers.Constant(0.0),
        optimizer=embedding.SGDOptimizerSpec(learning_rate=0.1),
        combiner=combiner,
        max_ids_per_partition=limit,
        max_unique_ids_per_partition=limit,
    )


def feature_specs(
    global_batch: int, *, limit: int = 256, t1_vocabulary: int = 64
) -> dict[str, embedding.FeatureSpec]:
    """Specs of `a` (table t1) and `b`, `c` (table t2, mean combiner)."""
    t1 = table("t1", t1_vocabulary, limit=limit)
    t2 = table("t2", 32, limit=limit, combiner="mean")
    return {
        name: embedding.FeatureSpec(
            name=name,
            table_spec=spec,
            input_shape=[global_batch, valency],
            output_shape=[global_batch, 8],
        )
        for name, spec, valency in (("a", t1, 3), ("b", t2, 2), ("c", t2, 1))
    }


def preprocess_config(
    global_batch: int,
    *,
    local_devices: int = 2,
    global_devices: int = 2,
    partitions: int = 2,
    limit: int = 256,
    t1_vocabulary: int = 64,
    **overrides,
) -> pipelines.PreprocessConfig:
    return pipelines.PreprocessConfig(
        feature_specs=feature_specs(global_batch, limit=limit, t1_vocabulary=t1_vocabulary),
        layout=LAYOUT,
        local_device_count=local_devices,
        global_device_count=global_devices,
        num_sc_per_device=partitions,
        **overrides,
    )


def write_dataset(directory: str, num_examples: int, *, seed: int = 0, num_shards: int = 2):
    """Writes the dataset in both formats; returns {format: files}."""
    return pipelines.write_synthetic_dataset(
        DATASET, directory, num_examples=num_examples, seed=seed, num_shards=num_shards
    )


def serialize_without(record: bytes, key: str) -> bytes:
    """`record` (a serialized Example) with feature `key` removed."""
    example = tf.train.Example.FromString(record)
    del example.features.feature[key]
    return example.SerializeToString()


def write_records(directory: str, records: list[bytes], *, num_shards: int = 2):
    """Writes `records` in order as ArrayRecord and TFRecord shards; returns {format: files}."""
    bounds = [shard * len(records) // num_shards for shard in range(num_shards + 1)]
    files = {}
    for fmt, extension in (("arrayrecord", ".array_record"), ("tfrecord", ".tfrecord")):
        os.makedirs(os.path.join(directory, fmt), exist_ok=True)
        files[fmt] = []
        for shard in range(num_shards):
            path = os.path.join(directory, fmt, f"part-{shard:05d}{extension}")
            with RecordFileWriter(path) as writer:
                for record in records[bounds[shard] : bounds[shard + 1]]:
                    writer.write(record)
            files[fmt].append(path)
    return files


def reference_batch(records: list[bytes], config: pipelines.PreprocessConfig, number: int):
    """The expected host batch of `records`: parsed and preprocessed directly."""
    parsed = pipelines.parse_examples(records, config.layout)
    names = list(config.feature_specs)
    weights = {
        name: parsed.weights.get(
            name,
            embedding.RaggedIds(
                np.ones(parsed.ids[name].values.size, np.float32), parsed.ids[name].row_splits
            ),
        )
        for name in names
    }
    preprocessed, stats = embedding.preprocess_sparse_dense_matmul_input(
        {name: parsed.ids[name] for name in names},
        weights,
        config.feature_specs,
        config.local_device_count,
        config.global_device_count,
        num_sc_per_device=config.num_sc_per_device,
        allow_id_dropping=config.allow_id_dropping,
        invalid_id_policy=config.invalid_id_policy,
    )
    sparse = pipelines.pack(preprocessed, config.local_device_count)
    batch = pipelines.HostBatch(number, sparse, parsed.dense, parsed.labels, None)
    return flat(batch), stats


def flat(batch) -> dict[str, np.ndarray]:
    """A host or device batch as {name: numpy array}, for comparisons."""
    out = {
        "batch_number": np.asarray(batch.batch_number),
        "dense": np.asarray(batch.dense),
        "labels": np.asarray(batch.labels),
        "num_minibatches": np.asarray(batch.preprocessed.num_minibatches),
    }
    fields = batch.preprocessed.sparse_dense_matmul_input._asdict()
    for field, per_stack in fields.items():
        for stack, array in per_stack.items():
            out[f"{stack}/{field}"] = np.asarray(array)
    return out


def assert_batches_equal(actual: list, expected: list) -> None:
    assert len(actual) == len(expected)
    for number, (got, want) in enumerate(zip(actual, expected)):
        assert sorted(got) == sorted(want), number
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"batch {number}: {key}")


def save_batches(path: str, batches: list[dict[str, np.ndarray]]) -> None:
    np.savez(path, **{f"{i}:{key}": v for i, b in enumerate(batches) for key, v in b.items()})


def load_batches(path: str) -> list[dict[str, np.ndarray]]:
    with np.load(path) as data:
        batches: dict[int, dict[str, np.ndarray]] = {}
        for name in data.files:
            index, key = name.split(":", 1)
            batches.setdefault(int(index), {})[key] = data[name]
    return [batches[i] for i in sorted(batches)]


def free_port_block(size: int) -> int:
    """A base port with `size` consecutive ports free on 127.0.0.1 right now."""
    for _ in range(100):
        base = int.from_bytes(os.urandom(2), "little") % 20000 + 30000
        sockets = []
        try:
            for port in range(base, base + size):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return base
    raise RuntimeError(f"No block of {size} free ports found.")
