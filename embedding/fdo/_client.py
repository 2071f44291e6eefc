"""The FDO client: records stats online, publishes them to files, loads and merges them.

Every process writes its own files (`fdo_stats-<source>-<time_ns>.json`,
written atomically: a hidden temporary file, then a rename) into a shared
directory; loading the directory merges the newest file of every source by
element-wise maximum.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np

from embedding._preprocess import SparseDenseMatmulInputStats
from embedding.checks import is_int
from embedding.fdo._file import FdoStats, FdoStatsError, StackFdoStats
from embedding.fdo._geometry import LIMIT_FIELDS, FdoGeometry
from embedding.fdo._layout import FdoLayout

_log = logging.getLogger(__name__)

_FILE_NAME = re.compile(r"^fdo_stats-(?P<source>[A-Za-z0-9_]+)-(?P<time>\d+)\.json$")


class OnMismatch(str, enum.Enum):
    """What `load_fdo_stats` does with a missing, corrupt or mismatching file."""

    RAISE = "raise"
    """Raise `FdoStatsError`."""
    WARN_AND_DEFAULT = "warn_and_default"
    """Log a warning and return None: the specs keep their configured limits."""


def merge_fdo_stats(stats: Sequence[FdoStats]) -> FdoStats:
    """Element-wise maxima of stats of one layout (or config) and geometry.

    Stats that all carry their layout are matched by it (the rest of their
    configs may differ); others by their config hash.

    The offline summaries (percentiles, histograms, id frequencies) describe
    one job's batches and cannot be merged: they are kept when a single stats
    object is given and dropped otherwise.

    Raises:
      ValueError: no stats, or stats of different layouts, configs or geometries.
    """
    if not stats:
        raise ValueError("merge_fdo_stats: no stats to merge.")
    if len(stats) == 1:
        return stats[0]
    first = stats[0]
    by_layout = all(s.layout for s in stats)
    for other in stats[1:]:
        if (_match_key(other, by_layout), other.geometry) != (
            _match_key(first, by_layout),
            first.geometry,
        ):
            raise ValueError(
                "Cannot merge FDO stats of different layouts, configs or geometries: "
                f"{_match_key(first, by_layout)[:12]} {first.geometry} vs "
                f"{_match_key(other, by_layout)[:12]} {other.geometry}."
            )
    names = list(dict.fromkeys(name for s in stats for name in s.stacks))
    stacks = {
        name: StackFdoStats(
            **{
                field: np.maximum.reduce(
                    [getattr(s.stacks[name], field) for s in stats if name in s.stacks]
                )
                for field in LIMIT_FIELDS
            }
        )
        for name in names
    }
    batches = max(s.batches for s in stats)
    return FdoStats(
        config_hash=first.config_hash,
        geometry=first.geometry,
        batches=batches,
        stacks=stacks,
        layout=first.layout,
    )


def _match_key(stats: FdoStats, by_layout: bool) -> str:
    return FdoLayout(entries=stats.layout).key if by_layout else stats.config_hash


def fdo_stats_file_name(source: str, time_ns: int | None = None) -> str:
    """`fdo_stats-<source>-<time_ns>.json`; `source` is `p00003` or `offline`."""
    name = f"fdo_stats-{source}-{time.time_ns() if time_ns is None else time_ns:020d}.json"
    if not _FILE_NAME.match(name):
        raise ValueError(f"FDO stats source must be letters, digits or '_', got {source!r}.")
    return name


def write_fdo_stats(stats: FdoStats, directory: str | os.PathLike, *, source: str) -> str:
    """Writes a stats file atomically; returns its path.

    The text goes to a hidden temporary file in `directory` (created if
    needed), renamed once complete, so a reader never sees a partial file.
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, fdo_stats_file_name(source))
    temp_path = os.path.join(directory, f".{os.path.basename(path)}.tmp")
    try:
        with open(temp_path, "w", encoding="utf-8") as file:
            file.write(stats.to_json())
        os.replace(temp_path, path)
    finally:
        if os.path.exists(temp_path):
            os.remove(temp_path)
    return path


def _newest_files(directory: str) -> list[str]:
    """The newest stats file of every source in `directory`."""
    newest: dict[str, tuple[int, str]] = {}
    for name in os.listdir(directory):
        match = _FILE_NAME.match(name)
        if match:
            candidate = (int(match["time"]), name)
            newest[match["source"]] = max(newest.get(match["source"], candidate), candidate)
    return [os.path.join(directory, name) for _, name in sorted(newest.values())]


def _read_stats_file(path: str) -> FdoStats:
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as e:
        raise FdoStatsError(path, f"cannot read the FDO stats file: {e}") from e
    return FdoStats.from_json(text, source=path)


def _check_expected(
    path: str, stats: FdoStats, expected: str | FdoLayout | None, geometry: FdoGeometry | None
) -> None:
    if isinstance(expected, FdoLayout):
        _check_layout(path, stats, expected)
    elif expected is not None and stats.config_hash != expected:
        raise FdoStatsError(
            path,
            f"computed for config hash {stats.config_hash[:16]}..., expected "
            f"{expected[:16]}... (the config changed since); rerun `sparseflow fdo` "
            "for this config.",
        )
    if geometry is not None and stats.geometry != geometry:
        differences = ", ".join(
            f"{f.name} {getattr(stats.geometry, f.name)} in the file, "
            f"{getattr(geometry, f.name)} expected"
            for f in dataclasses.fields(geometry)
            if getattr(stats.geometry, f.name) != getattr(geometry, f.name)
        )
        raise FdoStatsError(path, f"computed for another batch geometry: {differences}.")


def _check_layout(path: str, stats: FdoStats, layout: FdoLayout) -> None:
    if not stats.layout:  # written before stats carried their layout
        changed = "the stats hold no layout"
    elif FdoLayout(entries=stats.layout).key == layout.key:
        return
    else:
        changed = "; ".join(layout.differences(stats.layout))
    raise FdoStatsError(
        path,
        f"computed for another batch layout ({changed}); rerun `sparseflow fdo` for this config.",
    )


def load_fdo_stats(
    path: str | os.PathLike,
    *,
    expected_config_hash: str | FdoLayout | None,
    expected_geometry: FdoGeometry | None,
    on_mismatch: OnMismatch | str = OnMismatch.RAISE,
) -> FdoStats | None:
    """Loads a stats file, or merges the newest file of every source in a directory.

    Args:
      path: a stats file, or a directory of them (see `fdo_stats_file_name`).
      expected_config_hash: the run's layout (`FdoLayout`: stats of another
        layout are refused, naming the entries that changed; the rest of
        the config may differ), the run's config hash (the whole config
        must be the same), or None to accept any.
      expected_geometry: the run's geometry, or None to accept any.
      on_mismatch: "raise", or "warn_and_default" to log a warning and
        return None (keep the configured limits) instead.

    Returns:
      The (merged) stats, or None (see `on_mismatch`).

    Raises:
      FdoStatsError: the path does not exist or holds no stats file, a file
        is corrupt, or a file is for another config or geometry; names the
        file and what mismatched.
    """
    policy = OnMismatch(on_mismatch)
    try:
        return _load(os.fspath(path), expected_config_hash, expected_geometry)
    except FdoStatsError as e:
        if policy is OnMismatch.RAISE:
            raise
        _log.warning("Ignoring the FDO stats, using the configured limits: %s", e)
        return None


def _load(path: str, expected: str | FdoLayout | None, geometry: FdoGeometry | None) -> FdoStats:
    if os.path.isdir(path):
        files = _newest_files(path)
        if not files:
            raise FdoStatsError(path, "no FDO stats files (fdo_stats-*.json) in this directory.")
    elif os.path.exists(path):
        files = [path]
    else:
        raise FdoStatsError(path, "no such FDO stats file or directory.")
    loaded = []
    for file in files:
        stats = _read_stats_file(file)
        _check_expected(file, stats, expected, geometry)
        loaded.append(stats)
    try:
        return merge_fdo_stats(loaded)
    except ValueError as e:
        raise FdoStatsError(path, str(e)) from e


class FdoClient:
    """Records the online preprocessing's stats and shares them through files.

    Every process records the stats of its own batches, publishes them to
    its own file in a shared directory, and loads everyone's. Thread-safe.

    With a `layout` (`RunConfig.fdo_layout`), the published stats carry it
    and `load` takes every file of that layout, whatever the rest of the
    config that wrote it.

    Example:
      client = FdoClient(directory, config_hash=h, geometry=g, process_index=i,
                         layout=config.fdo_layout)
      for batch in batches:
          _, stats = embedding.preprocess_sparse_dense_matmul_input(...)
          client.record(stats)
      client.publish()
      specs = embedding.apply_fdo(specs, client.load())
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        config_hash: str,
        geometry: FdoGeometry,
        process_index: int = 0,
        layout: FdoLayout | None = None,
    ):
        if not is_int(process_index):
            raise TypeError(f"process_index must be an integer, got {process_index!r}.")
        if not 0 <= process_index < geometry.processes:
            raise ValueError(
                f"process_index {process_index} is outside [0, {geometry.processes}) "
                "(the geometry's processes)."
            )
        self.directory = os.fspath(directory)
        self.config_hash = config_hash
        self.layout = layout
        self.geometry = geometry
        self.process_index = process_index
        self._lock = threading.Lock()
        self._maxima: dict[str, dict[str, np.ndarray]] = {}
        self._batches = 0

    def record(self, stats: SparseDenseMatmulInputStats) -> None:
        """Folds one batch's stats into the running element-wise maxima.

        Raises:
          ValueError: the stats' shapes do not fit the client's geometry.
        """
        update = {
            name: {field: np.array(getattr(stats, field)[name]) for field in LIMIT_FIELDS}
            for name in stats.max_ids_per_partition
        }
        # Checks the shapes before anything is folded in.
        self._as_stats(update, 1)
        with self._lock:
            for name, fields in update.items():
                known = self._maxima.get(name)
                if known is not None:
                    fields = {f: np.maximum(known[f], fields[f]) for f in fields}
                self._maxima[name] = fields
            self._batches += 1

    def _as_stats(self, maxima: Mapping[str, Mapping[str, np.ndarray]], batches: int) -> FdoStats:
        stacks = {name: StackFdoStats(**fields) for name, fields in maxima.items()}
        try:
            return FdoStats(
                config_hash=self.config_hash,
                geometry=self.geometry,
                batches=batches,
                stacks=stacks,
                layout={} if self.layout is None else self.layout.entries,
            )
        except ValueError as e:
            raise ValueError(f"FdoClient.record: stats do not fit the geometry: {e}") from e

    def stats(self) -> FdoStats:
        """What this process has recorded so far."""
        with self._lock:
            return self._as_stats(self._maxima, self._batches)

    def publish(self) -> str:
        """Writes this process's stats to its own new file; returns the path.

        Raises:
          ValueError: nothing was recorded yet.
        """
        stats = self.stats()
        if not stats.batches:
            raise ValueError("FdoClient.publish: no stats recorded yet; call record() first.")
        return write_fdo_stats(stats, self.directory, source=f"p{self.process_index:05d}")

    def load(self, *, on_mismatch: OnMismatch | str = OnMismatch.RAISE) -> FdoStats | None:
        """Merges the newest stats file of every process (and the offline job).

        See `load_fdo_stats`; files must match the client's layout (or, without
        one, its config) and geometry.
        """
        return load_fdo_stats(
            self.directory,
            expected_config_hash=self.config_hash if self.layout is None else self.layout,
            expected_geometry=self.geometry,
            on_mismatch=on_mismatch,
        )
