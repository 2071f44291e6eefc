"""Orbax checkpoints of a training run, with fallback past damaged ones.

A checkpoint holds the dense state, the sharded embedding tables and slots,
the SC/TC pipeline state (a pipelined run is saved mid-flight, not drained,
so that a resumed run continues exactly), and the input iterator's position.
Orbax writes each step into a temporary directory and renames it when
complete, so a crash mid-write leaves no checkpoint that looks finished; a
checkpoint damaged afterwards (a missing or truncated file) fails to restore,
and the next older one is used, with a warning.
"""

from __future__ import annotations

import base64
import logging
from pathlib import Path
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp

_log = logging.getLogger(__name__)


class Snapshot(NamedTuple):
    """What a checkpoint restores.

    Attributes:
      step: pipeline calls (or sequential steps) done.
      arrays: the pytree of arrays (dense state, tables, pipeline state).
      iterator_state: the input iterator's position (opaque bytes).
      metadata: small JSON-able facts (losses so far, config hash, ...).
    """

    step: int
    arrays: Any
    iterator_state: bytes
    metadata: dict


class CheckpointError(RuntimeError):
    """No checkpoint in the directory could be restored."""


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpoints:
    """Saves and restores `Snapshot`s in one directory.

    Args:
      directory: where the checkpoints live (created if missing).
      keep: how many recent checkpoints to keep.
    """

    def __init__(self, directory: str | Path, *, keep: int = 3):
        self._manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        )

    def save(self, snapshot: Snapshot) -> None:
        """Writes `snapshot` (blocking until it is complete on disk)."""
        metadata = dict(
            snapshot.metadata,
            iterator_state=base64.b64encode(snapshot.iterator_state).decode("ascii"),
        )
        if snapshot.step in self._manager.all_steps():
            # Only a run resumed past a damaged checkpoint saves a step again.
            self._manager.delete(snapshot.step)
        self._manager.save(
            snapshot.step,
            args=ocp.args.Composite(
                arrays=ocp.args.StandardSave(snapshot.arrays),
                metadata=ocp.args.JsonSave(metadata),
            ),
            force=True,
        )
        self._manager.wait_until_finished()

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def restore_latest(self, like: Any) -> Snapshot | None:
        """The newest checkpoint that restores, or None if there is none.

        Args:
          like: a pytree of arrays with the shapes, dtypes and shardings to
            restore into (e.g. the freshly initialized state).

        Raises:
          CheckpointError: checkpoints exist but none restores.
        """
        steps = self.steps()
        errors = []
        for step in reversed(steps):
            try:
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        arrays=ocp.args.StandardRestore(_abstract(like)),
                        metadata=ocp.args.JsonRestore(),
                    ),
                )
            except Exception as e:  # noqa: BLE001 - any failure means "damaged": try older
                _log.warning(
                    "Checkpoint at step %d cannot be restored (%s); trying an older one.", step, e
                )
                errors.append(f"step {step}: {e}")
                continue
            metadata = dict(restored.metadata)
            state = base64.b64decode(metadata.pop("iterator_state"))
            # Orbax restores scalars onto one device; place every array as in `like`.
            arrays = jax.tree.map(lambda x, y: jax.device_put(x, y.sharding), restored.arrays, like)
            return Snapshot(step, arrays, state, metadata)
        if steps:
            raise CheckpointError("No checkpoint could be restored: " + "; ".join(errors))
        return None

    def close(self) -> None:
        self._manager.close()
