"""The batches in flight in a pipelined checkpoint, laid out again for another mesh.

A pipelined run is saved mid-flight (docs/design.md section 6): after `t`
calls its state holds batch `t-1`'s sparse input, activations, dense input
and lookup index (its TC stage runs next) and batch `t-2`'s sparse input,
activation gradients and lookup index (its table update runs next). The
activations, gradients and dense inputs are per sample in global batch
order, the same on any mesh; the sparse inputs and indices are laid out for
the mesh that wrote them. On another mesh those two batches are read again
from the data and laid out under this run's specs, as its input pipeline
would lay them out, and the lookup stage finds their indices; the rest is
carried over. A place that held no batch (before the first call, or the
zeros of a draining call) gets what this run's own initial state holds
there, as a draining call's stages never read it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

import parallel
import pipelines

# pipelines has no public reader of one training batch; these are what its
# Grain map (`pipelines/_grain.py`) reads and lays out each batch with.
from sparseflow._steps import Stages


def next_batch(iterator_state: bytes) -> int:
    """The batch after the last one the loop took (`pipelines.HostIterator.get_state`'s JSON)."""
    return int(json.loads(iterator_state)["next_batch"])


def read_batch(
    data,
    batching: pipelines.BatchingConfig,
    preprocess: pipelines.PreprocessConfig,
    mesh: Mesh,
    number: int,
) -> pipelines.DeviceBatch:
    """Global batch `number` of `pipelines.make_grain_iterator`, read and laid out here."""
    reader = pipelines.ArrayRecordReader(pipelines.list_record_files(data))
    plan = pipelines.batch_plan(reader.files.num_records, batching)
    stage = pipelines.PreprocessStage(preprocess)
    try:
        host = stage(number, reader.read(plan.record_indices(number)), plan=plan, reader=reader)
    finally:
        stage.close()
    return pipelines.to_device_batch(host, mesh)


def relaid_pipeline_state(
    saved: parallel.PipelineState,
    fresh: parallel.PipelineState,
    tables: Any,
    *,
    calls: int,
    next_batch: int,
    first_batch: int = 0,
    batch: Callable[[int], pipelines.DeviceBatch],
    stages: Stages,
) -> parallel.PipelineState:
    """The pipeline state of a checkpoint of another mesh, for this one.

    Args:
      saved: the checkpoint's state (its sparse inputs and indices of the
        other mesh are not read).
      fresh: this run's initial state (`parallel.get_initial_state`), whose
        shapes and placement the result has.
      tables: the tables, laid out for this mesh.
      calls: pipeline calls of its segment done when the checkpoint was
        written (call `c` of a segment feeds batch `first_batch + c`).
      next_batch: the first batch the loop had not taken then; batches from
        it on were a draining call's zeros.
      first_batch: the segment's first batch; the ones before it were all
        applied before the segment began.
      batch: reads a global batch, laid out for this mesh.
      stages: this run's stages (the lookup finds a batch's index).
    """
    lookup_index = jax.jit(lambda sparse, variables: stages.sc_fwd(sparse, variables)[1])

    def laid_out(number: int):
        if not first_batch <= number < next_batch:
            return None
        sparse = batch(number).sparse
        return sparse, lookup_index(sparse, tables)

    last = fresh.last_step_inputs._replace(
        embedding_activations=saved.last_step_inputs.embedding_activations,
        dense_inputs=saved.last_step_inputs.dense_inputs,
    )
    found = laid_out(first_batch + calls - 1)
    if found is not None:
        last = last._replace(sparse_inputs=found[0], sc_fwd_aux=found[1])
    before = fresh.step_before_last_step_inputs._replace(
        embedding_gradients=saved.step_before_last_step_inputs.embedding_gradients
    )
    found = laid_out(first_batch + calls - 2)
    if found is not None:
        # The TC aux is (the batch's dense step, its lookup index), `Stages.tc_per_feature`.
        step, _ = saved.step_before_last_step_inputs.tc_aux
        before = before._replace(sparse_inputs=found[0], tc_aux=(step, found[1]))
    state = fresh._replace(
        pipeline_step=saved.pipeline_step,
        last_step_inputs=last,
        step_before_last_step_inputs=before,
        placeholder_output=saved.placeholder_output,
    )
    return jax.tree.map(lambda x, y: jax.device_put(x, y.sharding), state, fresh)
