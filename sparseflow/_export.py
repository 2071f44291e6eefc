"""`sparseflow export`'s library: a run's newest checkpoint as a self-contained serving folder.

The checkpoint is restored as `sparseflow predict` restores it (`_predict.restore`,
onto the config's mesh); then every table is gathered off the mesh into one
array in vocabulary order (`embedding.gather_tables`), and the forward, the
plain-JAX lookup of each feature in its table (`embedding.dense_lookup`) then
the trainer's dense model (`forward` of `_dense_model`, its parameters built
in), is exported twice: serialized by `jax.export`, which
`sparseflow_serving.load_exported` runs with numpy and JAX alone, and as a
TensorFlow SavedModel (`jax2tf`) for TF Serving. The folder's layout is
`sparseflow_serving._manifest`'s.

The checkpoint records its run's layout, not its whole config (the model's
arguments, the record schema), so the export takes the run's config too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export

import embedding
import pipelines
from sparseflow import _dense_model, _predict, _train, retrieval
from sparseflow._errors import UsageError
from sparseflow._saved_model import write_saved_model
from sparseflow.config._run_config import RunConfig
from sparseflow_serving import _manifest

_log = logging.getLogger(__name__)

Forward = Callable[[dict, dict, dict, jax.Array], jax.Array]
"""`(tables, ids, weights, dense) -> float32[batch]`: tables `float32[vocabulary, dim]`
by table name; ids `int32[batch, length_f]` and weights `float32[batch, length_f]` by
feature; dense `float32[batch, num_dense_features]`."""


class Exported(NamedTuple):
    """What `export_model` wrote: the checkpoint's step, and the folder."""

    step: int
    path: Path


def export_model(
    config: RunConfig, checkpoint_dir: str | Path, out: str | Path, *, model: type | None = None
) -> Exported:
    """Writes the newest readable checkpoint of `config`'s run in `checkpoint_dir` to `out`.

    Args:
      config: the run's config.
      checkpoint_dir: the run's checkpoints (only read).
      out: an empty or new folder.
      model: the Flax NNX model class the run trained in place of `model.module`.

    A model whose outputs are not one logit per example (a two-tower
    retrieval model) has no forward to export: the item tower's vectors of
    every item are written instead (`TrainedTwoTower.every_item`).

    Raises:
      UsageError: `out` is not empty; no checkpoint; a model neither of
        logits nor of two towers.
      CheckpointMismatchError: the checkpoint is of another config.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"{out} is not empty; give sparseflow export an empty or new --out.")
    mesh = _train.make_mesh(config.mesh.devices)
    specs = embedding.prepare_feature_specs_for_training(
        config.feature_specs, mesh.size, config.mesh.partitions_per_device
    )
    dense_model = _dense_model.dense_model(config, mesh, model_class=model)
    snapshot = _predict.restore(config, mesh, dense_model, Path(checkpoint_dir))
    tables = embedding.gather_tables(
        {name: variables.table for name, variables in snapshot.arrays["tables"].items()},
        specs,
        mesh,
        num_sc_per_device=config.mesh.partitions_per_device,
    )
    # On the host: the program holds them as constants, not as arrays of the mesh.
    params = jax.tree.map(np.asarray, snapshot.arrays["state"].params)
    manifest = _manifest_of(config, specs, tables, snapshot.step)
    _write_tables(out, tables, params)
    if dense_model.per_example_logits:
        _write_forward(out, config, specs, tables, serving_forward(specs, dense_model, params))
        manifest.update(forward=_manifest.FORWARD_NAME, saved_model=_manifest.SAVED_MODEL_DIR)
    else:
        manifest.update(items=_write_items(out, config, dense_model, snapshot.arrays))
    (out / _manifest.MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    _log.info("Exported the checkpoint at step %d to %s.", snapshot.step, out)
    return Exported(snapshot.step, out)


def serving_forward(
    specs: Mapping[str, embedding.FeatureSpec], dense_model: Any, params: Any
) -> Forward:
    """The forward on unsharded tables: each feature's `embedding.dense_lookup`, then
    `dense_model.forward` with `params`."""
    features = {
        name: (spec.table_spec.name, spec.table_spec.combiner) for name, spec in specs.items()
    }

    def forward(tables, ids, weights, dense):
        activations = {
            name: embedding.dense_lookup(tables[table], ids[name], weights[name], combiner)
            for name, (table, combiner) in features.items()
        }
        return dense_model.forward(params, dense, activations)

    return forward


def _abstract_inputs(tables: Mapping[str, np.ndarray], features, num_dense: int) -> tuple:
    """The forward's inputs, a symbolic batch `b` and a symbolic length per feature."""
    batch, *lengths = jax_export.symbolic_shape(
        ", ".join(["b", *(f"l{i}" for i in range(len(features)))])
    )
    ids = {f: jax.ShapeDtypeStruct((batch, n), jnp.int32) for f, n in zip(features, lengths)}
    weights = {f: jax.ShapeDtypeStruct((batch, n), jnp.float32) for f, n in zip(features, lengths)}
    return (
        {name: jax.ShapeDtypeStruct(t.shape, t.dtype) for name, t in tables.items()},
        ids,
        weights,
        jax.ShapeDtypeStruct((batch, num_dense), jnp.float32),
    )


def _write_tables(out: Path, tables: Mapping[str, np.ndarray], params: Any) -> None:
    """Every table as one array, and the dense parameters by their path in the tree."""
    (out / _manifest.TABLES_DIR).mkdir(parents=True)
    for name, values in tables.items():
        np.save(out / _manifest.TABLES_DIR / f"{name}.npy", values)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    np.savez(
        out / _manifest.DENSE_PARAMS_NAME,
        **{jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves},
    )


def _write_forward(out: Path, config: RunConfig, specs, tables, forward: Forward) -> None:
    """The forward as a `jax.export` program and as a SavedModel, both without the CPU
    kernels' custom calls."""
    features = sorted(specs)
    num_dense = config.layout.num_dense_features
    inputs = _abstract_inputs(tables, features, num_dense)
    with embedding.without_cpu_kernels():
        program = jax_export.export(jax.jit(forward))(*inputs)
        write_saved_model(out / _manifest.SAVED_MODEL_DIR, forward, tables, features, num_dense)
    (out / _manifest.FORWARD_NAME).write_bytes(program.serialize())


def _write_items(out: Path, config: RunConfig, dense_model: Any, arrays: dict) -> dict:
    """A retrieval model's item tower on every item: their ids and vectors, for an
    approximate nearest neighbour index; returns their manifest entry.

    Raises:
      UsageError: the model is no two-tower model, or its item tower reads
        several features.
    """
    if not hasattr(dense_model, "graphdef"):
        raise UsageError(
            "The model's outputs are not one logit per example and it is no two-tower model; "
            "sparseflow export writes the forward of logit models and the item vectors of "
            "two-tower models."
        )
    towers = retrieval.TrainedTwoTower.of_arrays(
        config, dense_model, arrays["state"].params, arrays["tables"]
    )
    ids, vectors = towers.every_item()
    (out / _manifest.ITEMS_DIR).mkdir()
    np.save(out / _manifest.ITEM_IDS, ids)
    np.save(out / _manifest.ITEM_VECTORS, vectors)
    return {
        "feature": towers.model.item_features[0],
        "ids": _manifest.ITEM_IDS,
        "vectors": _manifest.ITEM_VECTORS,
        "shape": list(vectors.shape),
    }


def _manifest_of(config: RunConfig, specs, tables, step: int) -> dict:
    columns = {column.name: column for column in config.layout.schema.sparse}
    features = []
    for name in sorted(specs):
        column = columns[name]
        hashed = column.ids is pipelines.IdType.BYTES
        features.append(
            {
                "name": name,
                "table": specs[name].table_spec.name,
                "combiner": str(embedding.Combiner(specs[name].table_spec.combiner).value),
                "record_key": column.key,
                "weights_key": column.weights_key,
                "hashing": (
                    {"hash": "farmhash_fingerprint64", "buckets": column.hash_buckets}
                    if hashed
                    else None
                ),
            }
        )
    return {
        "format_version": _manifest.FORMAT_VERSION,
        "step": step,
        "config": config.name,
        "tables": {
            name: {
                "file": f"{_manifest.TABLES_DIR}/{name}.npy",
                "shape": list(values.shape),
                "dtype": str(values.dtype),
            }
            for name, values in sorted(tables.items())
        },
        "features": features,
        "dense": {
            "num_dense_features": config.layout.num_dense_features,
            "columns": [_dense_column(c) for c in config.layout.schema.dense],
        },
        "dense_params": _manifest.DENSE_PARAMS_NAME,
        "forward": None,
        "saved_model": None,
        "items": None,
    }


def _dense_column(column: pipelines.DenseColumn) -> dict:
    return {
        "key": column.key,
        "length": column.length,
        "default": column.default,
        "transform": column.transform.value,
        "mean": column.mean,
        "std": column.std,
    }
