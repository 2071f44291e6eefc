"""`sparseflow convert-checkpoint`: a run's checkpoint rewritten for another mesh, offline.

The newest checkpoint that reads in `--checkpoint-dir` (the one `--resume`
would take) is written to `--out` for the mesh of `--config` (its
`mesh.devices`, or `--devices N`, and its `mesh.partitions_per_device`),
without training and on this process's CPU: the tables and optimizer slots
move row by row (bitwise, `embedding.relayout_embedding_variables`), the
dense state, the step and the losses are copied, and so is every process's
input position, file by file. The limits the checkpoint recorded count ids
per partition of its own mesh and are left out, so the resumed run lays its
batches out under its own. `sparseflow train --resume` on the new mesh then
continues from `--out` as from a checkpoint of its own mesh.

The config must be the run's in everything but the mesh (checked as
`--resume` checks it, with the data the checkpoint records). A pipelined
checkpoint holds batches in flight, laid out for its mesh, which only the
data can lay out again: `--resume` on the new mesh does that, this command
refuses them.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sparseflow import _array_blocks, _mesh_change, _run_identity
from sparseflow._arguments import add_checkpoint_arguments, add_out_argument
from sparseflow._checkpoint import Checkpoints, Reading, Snapshot, check_fresh
from sparseflow._command_config import CommandConfig
from sparseflow._dense_model import dense_model
from sparseflow._dict_params import reading_dict_params
from sparseflow._errors import UsageError
from sparseflow._train import abstract_dense_state
from sparseflow.config._mesh import MeshConfig
from sparseflow.config._run_config import RunConfig

_log = logging.getLogger(__name__)

# The items a step folder holds that conversion writes anew; the others
# (the input positions, orbax's own step metadata) are copied as they are.
_REWRITTEN = ("arrays", "metadata")
# Orbax's prefix of a step being written: a crash's leftover is removed
# as one of orbax's (`_checkpoint`) when the folder is next opened.
_STAGING = "{step}.orbax-checkpoint-tmp-convert"


class Converted(NamedTuple):
    """What `convert_checkpoint` wrote.

    Attributes:
      step: the step of the checkpoint converted.
      written: the mesh that wrote it.
      target: the mesh it is laid out for now.
      path: the converted step's folder.
    """

    step: int
    written: MeshConfig
    target: MeshConfig
    path: Path


def convert_checkpoint(config: RunConfig, source: str | Path, out: str | Path) -> Converted:
    """Rewrites the newest readable checkpoint of `source` for `config`'s mesh, into `out`.

    Args:
      config: the run's config, on the mesh to convert for.
      source: the run's checkpoint folder (only read).
      out: an empty or new folder for the converted checkpoint.

    Raises:
      UsageError: `out` is not empty, or `source` holds no checkpoint.
      CheckpointMismatchError: the checkpoint is of another run, pipelined,
        or records no mesh.
      CheckpointError: no checkpoint in `source` reads.
    """
    source, out = Path(source), Path(out)
    check_fresh(out)
    if not source.is_dir() or not any(p.name.isdigit() for p in source.iterdir()):
        raise UsageError(f"{source} holds no checkpoint to convert.")
    device = Mesh(np.array(jax.local_devices(backend="cpu")[:1]), ("devices",))
    checkpoints = Checkpoints(source, run=None, read_only=True)
    try:
        read_as = _mesh_change.from_any_mesh(config, _Reader(config, device))
        snapshot = checkpoints.restore_latest(None, read_as=reading_dict_params(read_as, None))
    finally:
        checkpoints.close()
    written = _mesh_change.on_mesh(config, *_mesh_change.written_mesh(snapshot.metadata))
    path = _write(snapshot, source / str(snapshot.step), out, _metadata(snapshot, config))
    _log.info(
        "Converted the checkpoint at step %d from %s to %s: %s.",
        snapshot.step,
        _mesh_change.describe(written.mesh),
        _mesh_change.describe(config.mesh),
        path,
    )
    return Converted(snapshot.step, written.mesh, config.mesh, path)


class _Reader:
    """Reads a checkpoint of `config`'s run written on any mesh onto one CPU device."""

    def __init__(self, config: RunConfig, device: Mesh):
        self._config, self._device = config, device

    def __call__(self, written: RunConfig, metadata: dict) -> Reading:
        """How to read a checkpoint of `written` (this run's config on its mesh)."""
        run = metadata["run"]
        expected = dict(
            _run_identity.layout_identity(
                written, pipelined=False, processes=run["mesh"]["processes"]
            ),
            # The data is not read here: it stays what the checkpoint records.
            dataset=run.get("dataset"),
        )
        refusal = None
        if run.get("pipelined"):
            refusal = (
                "is of a pipelined run: it holds batches in flight laid out for "
                f"{_mesh_change.describe(written.mesh)}, which only the data can lay out "
                "again; resume it with `sparseflow train --resume` on the new mesh instead, "
                "which reads them again"
            )
        whole = NamedSharding(self._device, PartitionSpec())
        like = {
            "state": abstract_dense_state(
                self._config, dense_model(self._config, self._device), whole
            ),
            "tables": _mesh_change.saved_tables(written, self._device),
        }
        return Reading(expected, like, lambda snapshot: self._relaid(snapshot, written), refusal)

    def _relaid(self, snapshot: Snapshot, written: RunConfig) -> Snapshot:
        tables = _mesh_change.relaid_tables(
            snapshot.arrays["tables"], written, self._config, self._device
        )
        return snapshot._replace(arrays=dict(snapshot.arrays, tables=tables))


def _metadata(snapshot: Snapshot, config: RunConfig) -> dict:
    run = snapshot.metadata["run"]
    identity = dict(
        _run_identity.layout_identity(config, pipelined=False, processes=run["mesh"]["processes"]),
        dataset=run["dataset"],
    )
    return dict(
        snapshot.metadata,
        run=identity,
        arrays_layout=_run_identity.array_layout(snapshot.arrays),
        config_hash=config.config_hash,
        # They count ids per partition of the old mesh; None: the run's own apply.
        limits=None,
    )


def _write(snapshot: Snapshot, step_folder: Path, out: Path, metadata: dict) -> Path:
    """The converted step in `out`, complete before it takes the step's name."""
    staging = out / _STAGING.format(step=snapshot.step)
    shutil.copytree(
        step_folder,
        staging,
        ignore=lambda folder, names: _REWRITTEN if Path(folder) == step_folder else (),
    )
    with ocp.Checkpointer(_array_blocks.handler()) as checkpointer:
        checkpointer.save(staging / "arrays", args=_array_blocks.save_args(snapshot.arrays))
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as checkpointer:
        checkpointer.save(staging / "metadata", args=ocp.args.JsonSave(metadata))
    final = out / str(snapshot.step)
    staging.rename(final)
    return final


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_checkpoint_arguments(
        parser,
        "the run's YAML config on the mesh to convert for",
        "the run's checkpoints (only read: the run may still be writing them)",
    )
    add_out_argument(parser, "an empty or new folder for the converted one")


def run(args: argparse.Namespace, command_config: CommandConfig) -> None:
    converted = convert_checkpoint(command_config.load(), args.checkpoint_dir, args.out)
    print(
        f"Converted the checkpoint at step {converted.step} from "
        f"{_mesh_change.describe(converted.written)} to "
        f"{_mesh_change.describe(converted.target)}: {converted.path}"
    )
