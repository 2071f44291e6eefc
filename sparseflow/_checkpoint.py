"""Orbax checkpoints of one training run, with fallback past damaged ones.

A checkpoint holds the dense state, the sharded embedding tables and slots,
the SC/TC pipeline state (a pipelined run is saved mid-flight, not drained,
so that a resumed run continues exactly), every process's input iterator
position, and the identity of the run that wrote it (`_run_identity`) with
its arrays' layout.

Orbax writes each step into a temporary directory and renames it when
complete, so a crash mid-write leaves no checkpoint that looks finished; the
temporary directories such a crash leaves are removed when the folder is
opened. A checkpoint damaged afterwards (a missing or truncated file) fails
to restore, and the next older one is used, with a warning. A checkpoint of
another run, or with other arrays, is an error, not damage: falling back
would walk through every step and restart the run from scratch.

Each checkpoint is read as a `Reading` says: by default as this run's own
arrays; a run can read a checkpoint of another layout (another mesh,
`_mesh_change`) into other shapes and adapt what it restored.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import grain
import jax
import orbax.checkpoint as ocp

from embedding import SparseflowError
from sparseflow import _array_blocks, _hosts, _run_identity
from sparseflow._errors import UsageError

_log = logging.getLogger(__name__)

# A step set aside while its replacement is written (`Checkpoints.save`).
_SET_ASIDE = re.compile(r"^(\d+)\.replaced$")
# Where orbax writes a step before renaming it to the step's number.
_TEMPORARY = re.compile(r"^\d+\.orbax-checkpoint-tmp")
# A failed save's folder is removed again until it has stayed away this long
# (seconds), for at most `_REMOVAL_LIMIT` (`_remove_while_written`).
_REMOVAL_SETTLE, _REMOVAL_LIMIT = 2.0, 30.0
# A checkpoint's items: the arrays, the metadata, the input positions.
_ARRAYS, _METADATA, _INPUT = "arrays", "metadata", "input"
# One process's file in the input positions (Grain's naming).
_POSITION_FILE = re.compile(r"^process_(\d+)-of-(\d+)\.json$")


class Snapshot(NamedTuple):
    """What a checkpoint restores.

    Attributes:
      step: pipeline calls (or sequential steps) done.
      arrays: the pytree of arrays (dense state, tables, pipeline state).
      iterator_state: this process's input iterator position (UTF-8 bytes,
        e.g. the JSON of `HostIterator.get_state`); a checkpoint holds every
        process's.
      metadata: small JSON-able facts (losses so far, the run's identity, ...).
    """

    step: int
    arrays: Any
    iterator_state: bytes
    metadata: dict


class Reading(NamedTuple):
    """How one checkpoint is read into this run.

    Attributes:
      run: the identity of the run it must have been written by (None: any).
      like: the arrays it must hold (shapes and dtypes), with the shardings
        to restore them with.
      adapt: turns the restored snapshot into this run's (e.g. lays tables
        out for this mesh); by default it is this run's as it is.
      refusal: why this run cannot take the checkpoint at all, or None.
      partial: read only the top-level items of `like` (e.g. the dense state
        and the tables of a pipelined run's checkpoint, not its batches in
        flight), leaving the checkpoint's other items unread.
    """

    run: Mapping[str, Any] | None
    like: Any
    adapt: Callable[[Snapshot], Snapshot] = lambda snapshot: snapshot
    refusal: str | None = None
    partial: bool = False


ReadAs = Callable[[dict, Any], Reading | None]
"""`(a checkpoint's metadata, this run's arrays) -> Reading`, or None to read it as this run's."""


class CheckpointError(RuntimeError):
    """No checkpoint in the directory could be restored, or the processes disagree on them."""


class CheckpointSaveError(SparseflowError, OSError):
    """A checkpoint could not be written (e.g. the disk is full); the earlier ones are whole."""


class CheckpointMismatchError(SparseflowError, ValueError):
    """The checkpoint was written by another run, or holds other arrays than this run's."""


def check_fresh(directory: str | Path) -> None:
    """Checks that a run starting afresh may write its checkpoints into `directory`.

    Raises:
      UsageError: `directory` holds anything (another run's checkpoints would
        mix with this run's); the message says how to proceed.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return
    entries = sorted(entry.name for entry in directory.iterdir())
    if entries:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise UsageError(
            f"Checkpoint folder {directory} is not empty ({shown}): it holds an earlier "
            "run's checkpoints. Pass --resume to continue that run, or give this run an "
            "empty or new --checkpoint-dir (delete the folder first if its run is no "
            "longer needed)."
        )


class Checkpoints:
    """Saves and restores `Snapshot`s of one run in one directory.

    Every process of the run opens it and makes every call, in the same order.

    Args:
      directory: where the checkpoints live (created if missing).
      run: the identity of the run (`_run_identity.run_identity`): saved with
        every checkpoint, and what a restored one must have been written by;
        None to read a checkpoint of any run (to inspect it, not to resume;
        one written by another number of processes then restores an empty
        input position).
      keep: how many recent checkpoints to keep.
      read_only: only read the folder, which a run may still be writing: the
        steps a crash (or that run) left unfinished stay, and `save` is
        refused.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        run: Mapping[str, Any] | None,
        keep: int = 3,
        read_only: bool = False,
    ):
        self._directory = Path(directory).absolute()
        self._run = None if run is None else dict(run)
        self._read_only = read_only
        if not read_only and jax.process_index() == 0 and self._directory.is_dir():
            _recover_from_crash(self._directory)
        _hosts.barrier("sparseflow:checkpoints_recovered")
        handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()
        # Compressed checkpoints of earlier runs still restore.
        handlers.add(_ARRAYS, ocp.args.PyTreeSave, _array_blocks.handler())
        # Restores read the items through their handlers, not the manager:
        # the manager's restore ends in a barrier that a process whose read
        # failed never reaches, so the others would wait there forever.
        # `_hosts` agrees on the outcome instead.
        self._arrays_handler = ocp.StandardCheckpointHandler()
        self._metadata_handler = ocp.JsonCheckpointHandler()
        self._input_handler = grain.checkpoint.CheckpointHandler()
        handlers.add(_METADATA, ocp.args.JsonSave, self._metadata_handler)
        handlers.add(_INPUT, grain.checkpoint.CheckpointSave, self._input_handler)
        self._manager = ocp.CheckpointManager(
            self._directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=not read_only, read_only=read_only
            ),
            handler_registry=handlers,
        )

    def save(self, snapshot: Snapshot) -> None:
        """Writes `snapshot` (blocking until it is complete on disk).

        A step already there (one a resumed run fell back past, as damaged)
        is set aside, and deleted only once its replacement is complete.

        Raises:
          CheckpointSaveError: the write failed (a full disk, a lost mount):
            what it wrote is removed, a step set aside is put back, and the
            message names the folder and the steps still there.
        """
        if self._read_only:
            raise ValueError(f"The checkpoints in {self._directory} were opened read-only.")
        # Only process 0 writes the metadata; each process writes its own position.
        _check_utf8(snapshot.iterator_state)
        metadata = dict(
            snapshot.metadata,
            run=self._run,
            arrays_layout=_run_identity.array_layout(snapshot.arrays),
        )
        set_aside = None
        if snapshot.step in self._manager.all_steps():
            set_aside = self._set_aside(snapshot.step)
        try:
            self._manager.save(
                snapshot.step,
                args=ocp.args.Composite(
                    **{
                        _ARRAYS: _array_blocks.save_args(snapshot.arrays),
                        _METADATA: ocp.args.JsonSave(metadata),
                        _INPUT: grain.checkpoint.CheckpointSave(_Position(snapshot.iterator_state)),
                    }
                ),
                force=True,
            )
            self._manager.wait_until_finished()
        except (OSError, ValueError, RuntimeError) as error:
            raise self._failed_save(snapshot.step, set_aside, error) from error
        if set_aside is not None and jax.process_index() == 0:
            shutil.rmtree(set_aside)

    def _failed_save(self, step: int, set_aside: Path | None, error: Exception):
        """Stops the writers, undoes what a failed save of `step` left, and says what
        is still there. The folder is closed afterwards."""
        # Orbax's writers of the other arrays may still be running: left alone
        # they write on after the clean-up, and print tracebacks at exit.
        try:
            self.close()
        except (OSError, ValueError, RuntimeError) as closing:
            _log.warning("Closing the checkpoint writers after the failed save: %s", closing)
        if jax.process_index() == 0:
            # What the save wrote is its own to delete: it may be what filled the disk.
            for entry in self._directory.iterdir():
                if _TEMPORARY.match(entry.name) and entry.name.startswith(f"{step}."):
                    _remove_while_written(entry)
            if set_aside is not None:
                os.rename(set_aside, self._directory / str(step))
        kept = sorted(int(p.name) for p in self._directory.iterdir() if p.name.isdigit())
        there = (
            f"the checkpoints of steps {', '.join(map(str, kept))} are whole; after fixing "
            f"the cause, --resume goes on from step {kept[-1]}"
            if kept
            else "no earlier checkpoint is there"
        )
        return CheckpointSaveError(
            f"Writing the checkpoint of step {step} into {self._directory} failed "
            f"({type(error).__name__}: {error}); training stopped. What it wrote was removed "
            f"and {there}."
        )

    def _set_aside(self, step: int) -> Path:
        set_aside = self._directory / f"{step}.replaced"
        if jax.process_index() == 0:
            os.rename(self._directory / str(step), set_aside)
        _hosts.barrier(f"sparseflow:checkpoint_{step}_set_aside")
        self._manager.reload()
        return set_aside

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def newest_metadata(self) -> dict | None:
        """The metadata of the newest checkpoint whose metadata reads, or None."""
        for step in reversed(self.steps()):
            metadata, _ = self._metadata(step)
            if metadata is not None:
                return metadata
        return None

    def restore_latest(self, like: Any, read_as: ReadAs | None = None) -> Snapshot | None:
        """The newest checkpoint that restores on every process, or None if there is none.

        Args:
          like: a pytree of arrays with the shapes, dtypes and shardings to
            restore into (e.g. the freshly initialized state).
          read_as: how to read a checkpoint, given its metadata (e.g. one of
            another mesh); by default, into `like` as this run's own.

        Raises:
          CheckpointMismatchError: the newest readable checkpoint was written
            by another run, or holds other arrays than `like`.
          CheckpointError: checkpoints exist but none restores on every
            process, or the processes see different checkpoints.
        """
        steps = self.steps()
        if not _hosts.same_everywhere(steps):
            raise CheckpointError(
                f"The processes see different checkpoints in {self._directory} (this one: "
                f"steps {steps}); every process must read the same checkpoint folder."
            )
        errors = []
        for step in reversed(steps):
            snapshot, damage = self._restore(step, like, read_as)
            if _hosts.all_true(snapshot is not None):
                return snapshot
            damage = damage or "it does not restore on another process"
            _log.warning(
                "Checkpoint at step %d cannot be restored (%s); trying an older one.", step, damage
            )
            errors.append(f"step {step}: {damage}")
        if steps:
            raise CheckpointError("No checkpoint could be restored: " + "; ".join(errors))
        return None

    def _restore(
        self, step: int, like: Any, read_as: ReadAs | None
    ) -> tuple[Snapshot | None, str | None]:
        """The checkpoint at `step`, or None and why it is damaged.

        Raises:
          CheckpointMismatchError: it is of another run, on any process.
        """
        metadata, damage = self._metadata(step)
        reading = None if metadata is None or read_as is None else read_as(metadata, like)
        if reading is None:
            reading = Reading(self._run, like)
        step_directory = self._directory / str(step)
        mismatch = (
            None
            if metadata is None
            else _mismatch(metadata, reading, step_directory, resuming=self._run is not None)
        )
        if not _hosts.all_true(mismatch is None):
            advice = (
                " Resume with the config and data it was written with, or give this run an "
                "empty or new --checkpoint-dir."
                if self._run is not None
                else ""
            )
            raise CheckpointMismatchError(
                f"The checkpoint at step {step} in {self._directory} "
                f"{mismatch or 'is of another run on another process (see its error)'}.{advice}"
            )
        if metadata is None:
            return None, damage
        position = _Position()
        try:
            arrays_directory, abstract = step_directory / _ARRAYS, abstract_like(reading.like)
            restored = (
                _restore_partially(arrays_directory, abstract)
                if reading.partial
                else _array_blocks.restore(arrays_directory, abstract)
            )
            if restored is None:  # arrays stored whole, by an earlier version
                restored = self._arrays_handler.restore(
                    arrays_directory, args=ocp.args.StandardRestore(abstract)
                )
            inspected_elsewhere = self._run is None and jax.process_count() not in _input_processes(
                step_directory
            )
            if not inspected_elsewhere:
                self._input_handler.restore(
                    step_directory / _INPUT, args=grain.checkpoint.CheckpointRestore(position)
                )
        except Exception as e:  # noqa: BLE001 - the layout matches: a failure means damaged files
            return None, str(e)
        state = b"" if inspected_elsewhere else position.get_state()
        # Orbax restores scalars onto one device; place every array as in `like`.
        arrays = jax.tree.map(lambda x, y: jax.device_put(x, y.sharding), restored, reading.like)
        # The host copies orbax read the arrays into stay in reference cycles:
        # left to the collector, a resumed run trains beside a second copy of
        # its tables for as long as the collector waits.
        gc.collect()
        return reading.adapt(Snapshot(step, arrays, state, metadata)), None

    def _metadata(self, step: int) -> tuple[dict | None, str | None]:
        try:
            metadata = self._metadata_handler.restore(
                self._directory / str(step) / _METADATA, args=ocp.args.JsonRestore()
            )
        except Exception as e:  # noqa: BLE001 - any failure to read it means "damaged"
            return None, str(e)
        return dict(metadata), None

    def close(self) -> None:
        self._manager.close()
        self._arrays_handler.close()
        self._input_handler.close()


class _Position:
    """One process's input position, as Grain's checkpoint handler saves and
    restores an iterator: `get_state() -> bytes`, `set_state(bytes)`.

    The handler gets this holder, not the live iterator: a step's position is
    the one after the step's own batch (`DeviceIterator` keeps it with the
    batch), while the iterator itself has prefetched further.
    """

    def __init__(self, state: bytes = b""):
        self._state = state

    def get_state(self) -> bytes:
        return self._state

    def set_state(self, state: bytes) -> None:
        self._state = state

    def start_prefetch(self) -> None:
        """Nothing to prefetch: the position is handed to the iterator later."""


def _check_utf8(state: bytes) -> None:
    try:
        state.decode()
    except UnicodeDecodeError as error:
        raise ValueError(
            "The input iterator state must be UTF-8 (Grain's checkpoint handler stores it as "
            f"text), e.g. the JSON of HostIterator.get_state(); got {state[:60]!r}."
        ) from error


def _input_processes(step_directory: Path) -> set[int]:
    """The process counts of the input positions saved in a step."""
    found = set()
    for entry in (step_directory / _INPUT).glob("process_*-of-*.json"):
        match = _POSITION_FILE.match(entry.name)
        if match:
            found.add(int(match.group(2)))
    return found


def _mismatch(
    metadata: dict, reading: Reading, step_directory: Path, *, resuming: bool
) -> str | None:
    """How the checkpoint's run, arrays or processes differ from what `reading` expects, or None.

    The input positions are checked only when `resuming` (an inspection
    reads the arrays alone).
    """
    run = reading.run
    if "iterator_states" in metadata:
        return (
            "was written by an earlier sparseflow (its input positions are inside the "
            "metadata, not saved by Grain's checkpoint handler); this version cannot resume it"
        )
    if reading.refusal is not None:
        return reading.refusal
    if run is not None:
        if metadata.get("run") is None:
            return "records no run identity (it was written by an earlier sparseflow)"
        found = _run_identity.differences(metadata["run"], run)
        if found:
            return f"was written by another run: {_run_identity.describe(found)}"
    saved = metadata.get("arrays_layout", {})
    if reading.partial:
        saved = {path: layout for path, layout in saved.items() if path.startswith(_items(reading))}
    found = _run_identity.differences(saved, _run_identity.array_layout(reading.like), "arrays")
    if found:
        return f"holds other arrays than this run: {_run_identity.describe(found)}"
    counts = _input_processes(step_directory) if resuming else set()
    if counts and jax.process_count() not in counts:
        return (
            f"holds the input positions of {sorted(counts)} processes, not of {jax.process_count()}"
        )
    return None


def _remove_while_written(folder: Path) -> None:
    """Removes `folder`, and again while late writes of the failed save land in it.

    Orbax stops waiting for a save at its first failed write; the writes of
    other items and chunks already under way go on in threads of orbax and
    TensorStore, and TensorStore creates a file's missing parent folders, so
    one of them can bring the folder back after it was removed (seen on
    loaded machines, never reproduced on an idle one). The folder is removed
    until it has stayed away for `_REMOVAL_SETTLE` seconds, for at most
    `_REMOVAL_LIMIT`; a folder that still comes back is named in a warning
    (the next run's opening of the folder removes it, `_recover_from_crash`).
    """
    deadline = time.monotonic() + _REMOVAL_LIMIT
    while True:
        shutil.rmtree(folder, ignore_errors=True)
        gone_since = time.monotonic()
        while not folder.exists() and time.monotonic() - gone_since < _REMOVAL_SETTLE:
            time.sleep(0.05)
        if not folder.exists():
            return
        if time.monotonic() > deadline:
            _log.warning("%s could not be removed completely; delete it by hand.", folder)
            return
        time.sleep(0.05)


def _recover_from_crash(directory: Path) -> None:
    """Removes the steps a crash left unfinished, and finishes an interrupted replacement.

    Of a replacement, the new step is kept if it was committed, else the old
    one is put back. Orbax's own clean-up of unfinished steps runs in the
    background, so a run could list them while it goes on; this one is done
    before the folder is opened.
    """
    for entry in sorted(directory.iterdir()):
        if _TEMPORARY.match(entry.name):
            _log.info("Removing %s, a checkpoint a crash left unfinished.", entry)
            shutil.rmtree(entry)
    for entry in directory.iterdir():
        match = _SET_ASIDE.match(entry.name)
        if match is None:
            continue
        step = directory / match.group(1)
        if step.exists():
            shutil.rmtree(entry)
        else:
            os.rename(entry, step)


def _items(reading: Reading) -> tuple[str, ...]:
    """The path prefixes (`['state']`) of the top-level items `reading.like` holds."""
    return tuple(jax.tree_util.keystr((jax.tree_util.DictKey(key),)) for key in reading.like)


def _restore_partially(directory: Path, abstract: Any) -> Any:
    """The arrays of `abstract` (shapes, dtypes, shardings) from a step's `arrays` item,
    which may hold more."""
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), abstract)
    return ocp.PyTreeCheckpointHandler().restore(
        directory,
        args=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args, partial_restore=True),
    )


def abstract_like(tree: Any) -> Any:
    """The shape, dtype and sharding of each array of `tree` (what a restore reads into)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
