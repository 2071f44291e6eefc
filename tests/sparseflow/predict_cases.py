"""Records, a trained checkpoint and the trainer's evaluation scores, for the prediction
and export tests."""

from __future__ import annotations

import jax
import numpy as np
import tensorflow as tf

import embedding
import pipelines
from sparseflow import _dense_model, _train
from sparseflow._steps import DenseInputs

# Not a multiple of the global batch (512): the last batch of a prediction is padded.
PREDICTED_RECORDS = 1100


def write_records(path, records: list[bytes]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with pipelines.RecordFileWriter(path) as writer:
        for record in records:
            writer.write(record)
    return str(path)


def with_feature(record: bytes, key: str, feature: tf.train.Feature | None) -> bytes:
    """`record` with `key` set to `feature` (None: removed)."""
    example = tf.train.Example.FromString(record)
    if feature is None:
        del example.features.feature[key]
    else:
        example.features.feature[key].CopyFrom(feature)
    return example.SerializeToString()


def evaluation_scores(config, result, data: str, room: int | None = None) -> np.ndarray:
    """The trainer's evaluation forward (`Stages.eval_logits` on its evaluation batches)
    with the run's final parameters and tables: `float32[whole batches x batch]`.
    `room`: every stack's limits, in place of the config's."""
    mesh = _train.make_mesh(config.mesh.devices)
    specs = embedding.prepare_feature_specs_for_training(
        config.feature_specs, mesh.size, config.mesh.partitions_per_device
    )
    if room is not None:
        limits = embedding.StackLimits(
            max_ids_per_partition=room, max_unique_ids_per_partition=room
        )
        specs = embedding.set_stack_limits(
            specs,
            dict.fromkeys(embedding.stack_limits(specs), limits),
            global_device_count=mesh.size,
            num_sc_per_device=config.mesh.partitions_per_device,
        )
    options = _train.TrainOptions(data=data)
    stages = _train.stages(config, specs, mesh, _dense_model.dense_model(config, mesh))
    scores = []
    with _train._iterator(config, options, specs, mesh, data, training=False) as batches:
        for batch in batches:
            out = stages.eval_logits(
                result.train_state.params,
                result.embedding_variables,
                batch.sparse,
                DenseInputs(batch.dense, batch.labels),
            )
            scores.append(np.asarray(jax.device_get(out)))
    return np.concatenate(scores)
