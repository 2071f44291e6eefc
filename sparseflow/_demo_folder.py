"""The demo's run folder: created with a marker, and only a marked folder is ever emptied.

The demo starts every run afresh (training merges every FDO stats file of
its directory, and resuming is off), so it clears its outputs. It clears them
only in a folder that holds its marker, written when the demo created the
folder: a folder of the same name made by anyone else is refused, never
emptied.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from sparseflow._errors import UsageError

_log = logging.getLogger(__name__)

MARKER_NAME = ".sparseflow-demo-run"
_MARKER_TEXT = (
    "Created by `sparseflow demo`, which empties this folder at the start of every demo run.\n"
)


def claim(folder: Path) -> Path:
    """Returns `folder` empty but for its marker, creating it if missing.

    Raises:
      UsageError: `folder` exists without the marker (or is not a plain
        directory); the demo deletes nothing in it.
    """
    folder = Path(os.path.abspath(folder))
    try:
        folder.mkdir(parents=True)
    except FileExistsError:
        _check_owned(folder)
        _empty(folder)
        return folder
    (folder / MARKER_NAME).write_text(_MARKER_TEXT)
    return folder


def _check_owned(folder: Path) -> None:
    if folder.is_symlink() or not folder.is_dir():
        raise UsageError(
            f"{folder} exists and is not a directory the demo created; the demo writes its "
            "outputs there. Move it away or change the config's dataset.dir."
        )
    if not (folder / MARKER_NAME).is_file():
        raise UsageError(
            f"{folder} exists but was not created by `sparseflow demo` (it has no "
            f"{MARKER_NAME} file), so the demo will not empty it for its outputs. Move it "
            "away, or point the config's dataset.dir elsewhere."
        )


def _empty(folder: Path) -> None:
    # The marker stays: a run stopped midway leaves a folder the next run
    # still recognizes as the demo's.
    for entry in os.scandir(folder):
        if entry.name == MARKER_NAME:
            continue
        _log.info("Deleting %s (an earlier demo run's output).", entry.path)
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
