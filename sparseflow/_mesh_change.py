"""Checkpoints of a run written on another mesh: checked, read and laid out for this one.

A checkpoint records the mesh that wrote it (its run identity's `mesh`).
Another device count or another number of partitions per device moves the
rows of every table and optimizer slot (`embedding.relayout_embedding_variables`,
bitwise) and, in a pipelined checkpoint, the layout of the batches in flight
(`_in_flight`). Nothing else depends on the mesh: the dense parameters and
their optimizer state are replicated, and the step, the losses and every
process's input position count global batches, which a run on any mesh
draws alike (the global batch is part of the identity). The checkpoint's
limits count ids per partition of its own layout, so the run lays batches
out under its own (the config's, or FDO stats of its own mesh).

What must stay: everything else the run identity holds (tables, features,
stacks, global batch, preprocessing, model, pipelining, input order, data),
checked as if this run were on the checkpoint's mesh, and the number of
processes, whose input positions are each process's share of every batch.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import embedding
from sparseflow._checkpoint import Reading, Snapshot
from sparseflow.config._mesh import MeshConfig, devices_noun
from sparseflow.config._run_config import RunConfig

_log = logging.getLogger(__name__)

_SHAPE = re.compile(r"\[([\d, ]*)\]$")


def written_mesh(metadata: Mapping[str, Any]) -> tuple[int, int] | None:
    """`(devices, partitions per device)` of the run that wrote a checkpoint, None if unrecorded."""
    mesh = (metadata.get("run") or {}).get("mesh")
    return None if mesh is None else (mesh["devices"], mesh["partitions_per_device"])


def from_any_mesh(
    config: RunConfig, reading: Callable[[RunConfig, dict], Reading]
) -> Callable[[dict, Any], Reading]:
    """A `read_as` of `Checkpoints.restore_latest` for checkpoints of `config`'s run on any
    mesh: `reading(config on the checkpoint's mesh, its metadata)`; a checkpoint that
    records no mesh is refused."""

    def read_as(metadata: dict, like: Any) -> Reading:
        del like  # the shapes come from the config on the checkpoint's mesh
        written = written_mesh(metadata)
        if written is None:
            return Reading(None, {}, refusal="records no mesh (an earlier sparseflow wrote it)")
        return reading(on_mesh(config, *written), metadata)

    return read_as


def written_here(metadata: Mapping[str, Any], config: RunConfig) -> bool:
    """Whether a checkpoint was written on this run's mesh (or records no mesh)."""
    written = written_mesh(metadata)
    return written is None or written == (config.mesh.devices, config.mesh.partitions_per_device)


def describe(mesh: MeshConfig) -> str:
    """E.g. "8 devices x 2 partitions"."""
    return f"{devices_noun(mesh.devices)} x {mesh.partitions_per_device} partitions"


def on_mesh(config: RunConfig, devices: int, partitions_per_device: int) -> RunConfig:
    """`config` as it would be on another mesh: the same stacks, laid out for it."""
    mesh = dataclasses.replace(
        config.mesh, devices=devices, partitions_per_device=partitions_per_device
    )
    specs = embedding.restack(config.feature_specs, devices, partitions_per_device)
    return dataclasses.replace(
        config, mesh=mesh, feature_specs={name: specs[name] for name in config.feature_specs}
    )


def relaid_tables(
    tables: Mapping[str, embedding.EmbeddingVariables],
    written: RunConfig,
    config: RunConfig,
    mesh: Mesh,
) -> dict[str, embedding.EmbeddingVariables]:
    """Tables and slots of a checkpoint of `written` (`on_mesh`), laid out for `config`'s mesh."""
    return embedding.relayout_embedding_variables(
        tables,
        written.feature_specs,
        config.feature_specs,
        from_devices=written.mesh.devices,
        from_sc_per_device=written.mesh.partitions_per_device,
        to_devices=config.mesh.devices,
        to_sc_per_device=config.mesh.partitions_per_device,
        mesh=mesh,
    )


def saved_tables(written: RunConfig, mesh: Mesh) -> dict[str, embedding.EmbeddingVariables]:
    """The shapes of the tables and slots of a checkpoint of `written`, to restore onto `mesh`."""
    return embedding.embedding_variables_shapes(
        written.feature_specs, written.mesh.devices, written.mesh.partitions_per_device, mesh
    )


def _processes_refusal(metadata: Mapping[str, Any]) -> str | None:
    """Why this run cannot take a checkpoint of another number of processes, or None."""
    written = metadata["run"]["mesh"]["processes"]
    if written == jax.process_count():
        return None
    return (
        f"was written by {written} processes and this run has {jax.process_count()}: each "
        "process saved the input position of its own share of every batch, which another "
        f"number of processes cannot take over; resume with --num-processes {written} (the "
        "devices and the partitions per device may change)"
    )


class OtherMesh:
    """Reads this run's checkpoints written on another mesh (`Checkpoints.restore_latest`'s
    `read_as`); a checkpoint of this mesh is read as usual.

    Args:
      config: this run's config.
      mesh: this run's mesh.
      identity: the run identity of this run on a given config (that of the
        checkpoint's mesh, `on_mesh`), to check the checkpoint against.
      in_flight: `(restored pipeline state, relaid tables, snapshot) -> this
        mesh's pipeline state` for a pipelined run (`_in_flight`), else None.
    """

    def __init__(
        self,
        config: RunConfig,
        mesh: Mesh,
        identity: Callable[[RunConfig], Mapping[str, Any]],
        in_flight: Callable[[Any, Any, Snapshot], Any] | None,
    ):
        self._config, self._mesh = config, mesh
        self._identity, self._in_flight = identity, in_flight

    def __call__(self, metadata: dict, like: Any) -> Reading | None:
        if written_here(metadata, self._config):
            return None
        written = on_mesh(self._config, *written_mesh(metadata))
        refusal = _processes_refusal(metadata)
        if refusal is None and self._in_flight is not None:
            refusal = self._in_flight_refusal(written)
        saved = dict(like, tables=saved_tables(written, self._mesh))
        if "pipeline" in like:
            pipeline = {"pipeline": like["pipeline"]}
            layout = metadata.get("arrays_layout", {})
            saved["pipeline"] = _written_shapes(pipeline, layout, self._mesh)["pipeline"]
        return Reading(
            run=self._identity(written),
            like=saved,
            adapt=lambda snapshot: self._adapt(snapshot, written),
            refusal=refusal,
        )

    def _in_flight_refusal(self, written: RunConfig) -> str | None:
        if jax.process_count() == 1 or not self._config.preprocessing.enable_minibatching:
            return None
        return (
            f"holds SC/TC pipelined batches in flight laid out for {describe(written.mesh)}; "
            "laying them out again for this mesh would need the hosts to agree on their "
            "minibatches outside the input pipeline, which a run of several processes "
            f"cannot: resume it on {describe(written.mesh)}"
        )

    def _adapt(self, snapshot: Snapshot, written: RunConfig) -> Snapshot:
        arrays = dict(snapshot.arrays)
        arrays["tables"] = relaid_tables(arrays["tables"], written, self._config, self._mesh)
        if self._in_flight is not None:
            arrays["pipeline"] = self._in_flight(arrays["pipeline"], arrays["tables"], snapshot)
        _log.warning(
            "The checkpoint at step %d was written on %s; its tables and slots are laid out "
            "again for %s. The limits it recorded count ids per partition of its own layout: "
            "batches are laid out under this run's limits instead.",
            snapshot.step,
            describe(written.mesh),
            describe(self._config.mesh),
        )
        return snapshot._replace(arrays=arrays)


def _written_shapes(like: Any, layout: Mapping[str, str], mesh: Mesh) -> Any:
    """`like` with the shapes the checkpoint's arrays layout records, to restore them.

    A leaf whose shape changed (it follows the mesh) is restored whole on
    every device: such leaves are a batch's layout, small next to a table.
    """
    whole = NamedSharding(mesh, PartitionSpec())

    def leaf(path, x) -> jax.ShapeDtypeStruct:
        written = layout.get(jax.tree_util.keystr(path))
        match = _SHAPE.search(written) if written else None
        if match is None:
            # Not recorded (or not an array layout): the arrays check names it.
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        shape = tuple(int(n) for n in match.group(1).split(",") if n.strip())
        sharding = x.sharding if shape == tuple(x.shape) else whole
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(leaf, like)
