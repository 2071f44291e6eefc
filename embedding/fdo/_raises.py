"""The feedback half of FDO: limits a training run had to raise, kept next to the stats.

A run whose batch breaches a limit (dropping off) raises that stack's limits
to what the batch needs and writes them to `fdo_limit_raises.json` in the
stats directory; the next run that loads the stats (`train --fdo DIR`) starts
from the larger of the stats' limits and these.

File format (JSON, UTF-8), version 1: an object with the `format` (here
"sparseflow.fdo_limit_raises"), `version` and `geometry` entries of the
stats file (`_file.py`), and these:

  {
    "layout_key": "<FdoLayout.key of the run>",
    "stacks": {"<stack>": {"max_ids_per_partition": int,
                           "max_unique_ids_per_partition": int,
                           "suggested_coo_buffer_size_per_device": int or null}},
    "batches": [<global batches that raised a limit, in order>]
  }
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping

from embedding._buffers import INT32_MAX
from embedding.fdo._file import FdoStatsError
from embedding.fdo._geometry import FdoGeometry
from embedding.fdo._layout import FdoLayout
from embedding.fdo._limits import StackLimits
from embedding.fdo._schema import INT64_MAX, SchemaError, integer, integers, item, json_object

_log = logging.getLogger(__name__)

LIMIT_RAISES_FILE_NAME = "fdo_limit_raises.json"
_FORMAT = "sparseflow.fdo_limit_raises"
_VERSION = 1
_LIMITS = ("max_ids_per_partition", "max_unique_ids_per_partition")
_BUFFER = "suggested_coo_buffer_size_per_device"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LimitRaises:
    """Limits training raised over the FDO stats' ones, for runs of one layout.

    Attributes:
      layout_key: `FdoLayout.key` of the runs they are for.
      geometry: the batch geometry.
      stacks: per raised stack, its limits after the raise.
      batches: the global batches that raised a limit, in order.
    """

    layout_key: str
    geometry: FdoGeometry
    stacks: Mapping[str, StackLimits]
    batches: tuple[int, ...] = ()

    def to_json(self) -> str:
        return (
            json.dumps(
                {
                    "format": _FORMAT,
                    "version": _VERSION,
                    "layout_key": self.layout_key,
                    "geometry": dataclasses.asdict(self.geometry),
                    "stacks": {
                        name: dataclasses.asdict(limits) for name, limits in self.stacks.items()
                    },
                    "batches": list(self.batches),
                },
                indent=1,
            )
            + "\n"
        )

    @classmethod
    def from_json(cls, text: str, *, source: str) -> LimitRaises:
        """Parses a raises file, strictly.

        Raises:
          FdoStatsError: not such a file, or an entry of the wrong type
            (named with `source`).
        """
        try:
            return _from_document(json.loads(text))
        except ValueError as e:
            raise FdoStatsError(source, f"corrupt FDO limit raises file: {e}") from e


def _from_document(document) -> LimitRaises:
    required = ("format", "version", "layout_key", "geometry", "stacks", "batches")
    root = json_object(document, "", required=required)
    if root["format"] != _FORMAT or root["version"] != _VERSION:
        raise SchemaError("format", f"must be {_FORMAT!r} version {_VERSION}")
    if not isinstance(root["layout_key"], str):
        raise SchemaError("layout_key", f"must be a string, got {root['layout_key']!r}")
    names = [f.name for f in dataclasses.fields(FdoGeometry)]
    geometry = FdoGeometry(**json_object(root["geometry"], "geometry", required=names))
    stacks = {}
    for name, value in json_object(root["stacks"], "stacks").items():
        entry = item("stacks", name)
        fields = json_object(value, entry, required=(*_LIMITS, _BUFFER))
        limits = {key: integer(fields[key], f"{entry}.{key}", high=INT32_MAX) for key in _LIMITS}
        buffer = fields[_BUFFER]
        if buffer is not None:
            buffer = integer(buffer, f"{entry}.{_BUFFER}", high=INT32_MAX)
        stacks[name] = StackLimits(**limits, suggested_coo_buffer_size_per_device=buffer)
    return LimitRaises(
        layout_key=root["layout_key"],
        geometry=geometry,
        stacks=stacks,
        batches=tuple(integers(root["batches"], "batches", high=INT64_MAX)),
    )


def limit_raises_path(fdo_path: str | os.PathLike) -> str:
    """Where the raises of runs using the stats at `fdo_path` (a file or directory) live."""
    fdo_path = os.fspath(fdo_path)
    directory = fdo_path if os.path.isdir(fdo_path) else os.path.dirname(fdo_path)
    return os.path.join(directory, LIMIT_RAISES_FILE_NAME)


def load_limit_raises(
    fdo_path: str | os.PathLike, *, layout: FdoLayout, geometry: FdoGeometry
) -> LimitRaises | None:
    """The raises recorded next to the stats at `fdo_path` for this layout, or None.

    Raises recorded for another layout or geometry are ignored, with a warning:
    they are a hint on top of the stats, which are checked strictly.

    Raises:
      FdoStatsError: the file is corrupt.
    """
    path = limit_raises_path(fdo_path)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as e:
        raise FdoStatsError(path, f"cannot read the FDO limit raises file: {e}") from e
    raises = LimitRaises.from_json(text, source=path)
    if raises.layout_key != layout.key or raises.geometry != geometry:
        _log.warning(
            "%s: limit raises of another batch layout or geometry; ignored (delete the file "
            "once the stats are recomputed for this layout).",
            path,
        )
        return None
    return raises


def write_limit_raises(fdo_path: str | os.PathLike, raises: LimitRaises) -> str:
    """Writes the raises next to the stats at `fdo_path` (atomically); returns the path."""
    path = limit_raises_path(fdo_path)
    temp_path = os.path.join(os.path.dirname(path), f".{LIMIT_RAISES_FILE_NAME}.tmp")
    with open(temp_path, "w", encoding="utf-8") as file:
        file.write(raises.to_json())
    os.replace(temp_path, path)
    return path
