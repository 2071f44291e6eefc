"""The input pipeline a jax-tpu-embedding user would build with tf.data.

The same records in TFRecord files, the same feature specs and limits:

    TFRecordDataset(files).repeat()
      .shuffle(SHUFFLE_BATCHES * host_batch)
      .batch(host_batch, drop_remainder=True)
      .map(tf.io.parse_example, num_parallel_calls=P)          # ragged features
      .map(numpy_function(jax-tpu-embedding's preprocessing), num_parallel_calls=P)
      .prefetch(PREFETCH)

The preprocessing takes each feature as a 1-D object array of rows, the form
that carries weights (its sparse-tensor entry point has none), with weights
of 1 for the unweighted features. The peer is the optional extra `bench`
(`make bench-env`): without it `peer_feature_specs` returns None.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax
import numpy as np
import tensorflow as tf

from pipelines import FeatureLayout
from pipelines._parse import DENSE_KEY, LABEL_KEY, weights_key

SHUFFLE_BATCHES = 16
PREFETCH = 2


def peer_feature_specs(specs: dict, global_devices: int, num_sc_per_device: int) -> dict | None:
    """jax-tpu-embedding's feature specs mirroring our prepared `specs`, or None.

    Same tables, stacks, shapes and combiners; each stack's limits and
    suggested buffer size are ours, set as jax-tpu-embedding's
    `update_preprocessing_parameters` sets FDO stats.
    """
    try:
        from jax_tpu_embedding.sparsecore.lib.nn import embedding as jte
        from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec as jte_spec
        from jax_tpu_embedding.sparsecore.lib.nn import table_stacking
    except ImportError:
        return None
    tables, features, stacks = {}, {}, {}
    for name, feature in specs.items():
        table = feature.table_spec
        if table.name not in tables:
            tables[table.name] = jte_spec.TableSpec(
                name=table.name,
                vocabulary_size=table.vocabulary_size,
                embedding_dim=table.embedding_dim,
                initializer=jax.nn.initializers.zeros,
                optimizer=jte_spec.SGDOptimizerSpec(),
                combiner=table.combiner.value,
            )
        features[name] = jte_spec.FeatureSpec(
            name=name,
            table_spec=tables[table.name],
            input_shape=list(feature.input_shape),
            output_shape=list(feature.output_shape),
        )
        members = stacks.setdefault(table.stacked_table_spec.stack_name, [])
        if table.name not in members:
            members.append(table.name)
    for stack, members in stacks.items():
        if len(members) > 1:
            table_stacking.stack_tables(
                features, members, global_devices, num_sc_per_device, stack_name=stack
            )
    jte.prepare_feature_specs_for_training(features, global_devices, num_sc_per_device)
    for name, feature in specs.items():
        ours = feature.table_spec.stacked_table_spec
        theirs = features[name].table_spec
        theirs.stacked_table_spec = dataclasses.replace(
            theirs.stacked_table_spec,
            max_ids_per_partition=ours.max_ids_per_partition,
            max_unique_ids_per_partition=ours.max_unique_ids_per_partition,
            suggested_coo_buffer_size_per_device=ours.suggested_coo_buffer_size_per_device,
        )
    return features


def _rows(values: np.ndarray, row_splits: np.ndarray) -> np.ndarray:
    rows = np.empty(row_splits.size - 1, dtype=object)
    rows[:] = np.split(values, row_splits[1:-1])
    return rows


def _parse_spec(layout: FeatureLayout) -> dict:
    """The `tf.io.parse_example` spec a user writes for the demo's records."""
    spec = {DENSE_KEY: tf.io.FixedLenFeature([layout.num_dense_features], tf.float32)}
    spec[LABEL_KEY] = tf.io.FixedLenFeature([], tf.int64)
    for name in layout.sparse:
        spec[name] = tf.io.RaggedFeature(tf.int64, row_splits_dtype=tf.int64)
        if name in layout.weighted:
            spec[weights_key(name)] = tf.io.RaggedFeature(tf.float32, row_splits_dtype=tf.int64)
    return spec


def tfdata_jte_batches(
    files: list[str],
    layout: FeatureLayout,
    peer_specs: dict,
    *,
    host_batch: int,
    local_devices: int,
    global_devices: int,
    num_sc_per_device: int,
    allow_id_dropping: bool,
    enable_minibatching: bool,
    parallel_calls: int,
    seed: int,
) -> Iterator:
    """Endless `(PreprocessedInput, dense, labels)` host batches of `files` (numpy).

    The pipeline is built, and its first batch parsed, when the first batch
    is asked for.
    """
    from jax_tpu_embedding.sparsecore.lib.nn import embedding as jte

    weighted = [name in layout.weighted for name in layout.sparse]

    def preprocess(*arrays):
        parts = iter(arrays)
        features, weights = {}, {}
        for name, has_weights in zip(layout.sparse, weighted):
            values, splits = next(parts), next(parts)
            features[name] = _rows(values.astype(np.int32), splits)
            gains = next(parts) if has_weights else np.ones(values.size, np.float32)
            weights[name] = _rows(gains, splits)
        dense, labels = next(parts), next(parts)
        out, _ = jte.preprocess_sparse_dense_matmul_input(
            features,
            weights,
            peer_specs,
            local_devices,
            global_devices,
            num_sc_per_device=num_sc_per_device,
            allow_id_dropping=allow_id_dropping,
            enable_minibatching=enable_minibatching,
        )
        leaves, structure = jax.tree.flatten(out)
        return leaves + [dense, labels], structure

    spec = _parse_spec(layout)

    def parse(records):
        parsed = tf.io.parse_example(records, spec)
        flat = []
        for name, has_weights in zip(layout.sparse, weighted):
            flat += [parsed[name].values, parsed[name].row_splits]
            if has_weights:
                flat.append(parsed[weights_key(name)].values)
        return (*flat, parsed[DENSE_KEY], parsed[LABEL_KEY])

    parsed = (
        tf.data.TFRecordDataset(files)
        .repeat()
        .shuffle(SHUFFLE_BATCHES * host_batch, seed=seed)
        .batch(host_batch, drop_remainder=True)
        .map(parse, num_parallel_calls=parallel_calls)
    )
    # numpy_function needs the output dtypes: one call on a first batch tells them.
    probe, structure = preprocess(*(x.numpy() for x in next(iter(parsed))))
    batches = parsed.map(
        lambda *xs: tf.numpy_function(
            lambda *arrays: preprocess(*arrays)[0],
            xs,
            [tf.as_dtype(array.dtype) for array in probe],
        ),
        num_parallel_calls=parallel_calls,
    ).prefetch(PREFETCH)
    for *leaves, dense, labels in batches.as_numpy_iterator():
        yield jax.tree.unflatten(structure, leaves), dense, labels
