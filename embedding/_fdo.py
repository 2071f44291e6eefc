"""FDO (feedback-directed optimization) stats: the file format, the client, the limits.

The preprocessing reports, per batch and stacked table, how many ids (and
distinct ids) each partition received and how much buffer each partition slot
needed (`SparseDenseMatmulInputStats`). Their maxima over many batches, with
some headroom, are the limits and buffer sizes a run should use: large enough
that nothing is dropped, small enough that the static-size buffers stay small.
They come from the offline job (`beam_jobs`, over the whole dataset before
training) or from `FdoClient` (recorded online, batch after batch).

File format (JSON, UTF-8), version 1:

  {
    "format": "sparseflow.fdo_stats",
    "version": 1,
    "config_hash": "<sha256 of the run config the stats were computed for>",
    "geometry": {"global_batch_size": B, "devices": G,
                 "partitions_per_device": S, "processes": P},
    "batches": <global batches the stats cover>,
    "stacks": {                                  # per stacked (physical) table
      "<stack>": {
        "max_ids_per_partition": [L*N ints],     # max over batches and hosts
        "max_unique_ids_per_partition": [L*N ints],
        "required_buffer_size_per_sc": [L*S ints],
        # optional, written by the offline job:
        "batch_max_percentiles": {"<one of the three stats above>":
            {"p50": int, "p90": int, "p99": int, "p99.9": int, "max": int}},
        "partition_histogram": {"values": [V ints], "counts": [N lists of V ints]}
      }
    },
    "tables": {                                  # optional, offline job only
      "<logical table>": {"ids": int, "distinct_ids": int,
                          "top_ids": [[id, count], ...]}
    }
  }

`L = G / P` local devices per host, `N = G * S` partitions. Index `d * N + p`
of a per-partition list is local device `d`, partition `p`; the maxima are
taken element-wise over every host, so one file serves every host. A
percentile of a stat is taken over the batches of that stat's batch maximum
(max over hosts, devices and partitions), exact, nearest-rank.
`partition_histogram.counts[p][i]` is the number of batches whose max ids in
partition `p` (max over hosts and devices) was `values[i]`.

Files are named `fdo_stats-<source>-<time_ns>.json`, `<source>` being
`p<process index, 5 digits>` for `FdoClient` and `offline` for the offline
job, and are written atomically (a hidden temporary file, then a rename).
Loading a directory merges the newest file of every source by element-wise
maximum.
"""

from __future__ import annotations

import dataclasses
import enum
import fractions
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from embedding._preprocess import SparseDenseMatmulInputStats
from embedding._specs import FeatureSpec, round_up
from embedding._stacking import (
    Nested,
    check_partition_count,
    get_stacked_table_specs,
    prepare_feature_specs_for_training,
)

_log = logging.getLogger(__name__)

FDO_STATS_FORMAT = "sparseflow.fdo_stats"
FDO_STATS_VERSION = 1
_FILE_NAME = re.compile(r"^fdo_stats-(?P<source>[A-Za-z0-9_]+)-(?P<time>\d+)\.json$")
_LIMIT_FIELDS = (
    "max_ids_per_partition",
    "max_unique_ids_per_partition",
    "required_buffer_size_per_sc",
)


class FdoStatsError(ValueError):
    """A stats file (or directory) that is missing, corrupt or for another run.

    Attributes:
      path: the file or directory.
    """

    def __init__(self, path: str | os.PathLike, message: str):
        super().__init__(f"{os.fspath(path)}: {message}")
        self.path = os.fspath(path)


class OnMismatch(str, enum.Enum):
    """What `load_fdo_stats` does with a missing, corrupt or mismatching file."""

    RAISE = "raise"
    """Raise `FdoStatsError`."""
    WARN_AND_DEFAULT = "warn_and_default"
    """Log a warning and return None: the specs keep their configured limits."""


def _positive_int(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FdoGeometry:
    """The batch geometry stats are computed for; other geometries need other stats.

    Attributes:
      global_batch_size: B, examples per global batch.
      devices: G, devices over all hosts.
      partitions_per_device: S.
      processes: P, hosts; host h takes rows `[h*B/P, (h+1)*B/P)` of a batch.
    """

    global_batch_size: int
    devices: int
    partitions_per_device: int
    processes: int = 1

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _positive_int(getattr(self, field.name), f"FdoGeometry.{field.name}")
        check_partition_count(self.devices, self.partitions_per_device)
        if self.devices % self.processes:
            raise ValueError(
                f"FdoGeometry: {self.processes} processes cannot share {self.devices} "
                "devices evenly."
            )
        if self.global_batch_size % self.num_partitions:
            raise ValueError(
                f"FdoGeometry: global_batch_size {self.global_batch_size} must be a "
                f"multiple of devices x partitions_per_device = {self.num_partitions}."
            )

    @property
    def num_partitions(self) -> int:
        """N = G * S."""
        return self.devices * self.partitions_per_device

    @property
    def local_devices(self) -> int:
        """L = G / P, devices of one host."""
        return self.devices // self.processes


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class StackFdoStats:
    """One stacked table's stats (max over batches and hosts).

    Attributes:
      max_ids_per_partition: `int32[L * N]`.
      max_unique_ids_per_partition: `int32[L * N]`.
      required_buffer_size_per_sc: `int32[L * S]`.
      batch_max_percentiles: per stat name above, {"p50", "p90", "p99",
        "p99.9", "max"} of the per-batch maxima, or None (online stats).
      partition_histogram: `int64[N, W]`, `[p, v]` = batches whose max ids in
        partition p was v, or None (online stats).
    """

    max_ids_per_partition: np.ndarray
    max_unique_ids_per_partition: np.ndarray
    required_buffer_size_per_sc: np.ndarray
    batch_max_percentiles: Mapping[str, Mapping[str, int]] | None = None
    partition_histogram: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name in _LIMIT_FIELDS:
            object.__setattr__(self, name, np.asarray(getattr(self, name), np.int32))
        if self.partition_histogram is not None:
            object.__setattr__(
                self, "partition_histogram", np.asarray(self.partition_histogram, np.int64)
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableIdFrequency:
    """How often a logical table's ids occur over the batches (offline job).

    Attributes:
      ids: ids seen (with repeats).
      distinct_ids: distinct ids seen (exact).
      top_ids: the most frequent `(id, count)` pairs, most frequent first
        (ties: smaller id first).
    """

    ids: int
    distinct_ids: int
    top_ids: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class FdoStats:
    """The FDO stats of a run (see the module docstring for the file format).

    Attributes:
      config_hash: the run config's hash (`RunConfig.config_hash`).
      geometry: the batch geometry.
      batches: global batches the stats cover.
      stacks: per stacked table name.
      tables: per logical table, its id frequencies (offline job; may be empty).
    """

    config_hash: str
    geometry: FdoGeometry
    batches: int
    stacks: Mapping[str, StackFdoStats]
    tables: Mapping[str, TableIdFrequency] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.config_hash, str):
            raise TypeError(f"config_hash must be a string, got {self.config_hash!r}.")
        if isinstance(self.batches, bool) or not isinstance(self.batches, int) or self.batches < 0:
            raise ValueError(f"batches must be an integer >= 0, got {self.batches!r}.")
        g = self.geometry
        shapes = {
            "max_ids_per_partition": g.local_devices * g.num_partitions,
            "max_unique_ids_per_partition": g.local_devices * g.num_partitions,
            "required_buffer_size_per_sc": g.local_devices * g.partitions_per_device,
        }
        for name, stack in self.stacks.items():
            for field, size in shapes.items():
                if getattr(stack, field).shape != (size,):
                    raise ValueError(
                        f"Stack {name!r}: {field} has shape {getattr(stack, field).shape}, "
                        f"expected ({size},) for {g}."
                    )

    def to_json(self) -> str:
        """The stats as the text of a stats file."""
        return json.dumps(_to_document(self), separators=(",", ":")) + "\n"

    @classmethod
    def from_json(cls, text: str, *, source: str | os.PathLike = "<text>") -> FdoStats:
        """Parses the text of a stats file.

        Raises:
          FdoStatsError: not a stats file of a known version, naming `source`
            and the bad entry.
        """
        try:
            document = json.loads(text)
        except json.JSONDecodeError as e:
            raise FdoStatsError(source, f"corrupt FDO stats file (not JSON: {e}).") from e
        try:
            return _from_document(document)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            detail = f"missing entry {e}" if isinstance(e, KeyError) else str(e)
            raise FdoStatsError(source, f"corrupt FDO stats file ({detail}).") from e


def _to_document(stats: FdoStats) -> dict:
    stacks = {}
    for name, stack in stats.stacks.items():
        entry = {field: getattr(stack, field).tolist() for field in _LIMIT_FIELDS}
        if stack.batch_max_percentiles is not None:
            entry["batch_max_percentiles"] = {
                k: {q: int(v) for q, v in p.items()} for k, p in stack.batch_max_percentiles.items()
            }
        if stack.partition_histogram is not None:
            entry["partition_histogram"] = _sparse_histogram(stack.partition_histogram)
        stacks[name] = entry
    return {
        "format": FDO_STATS_FORMAT,
        "version": FDO_STATS_VERSION,
        "config_hash": stats.config_hash,
        "geometry": dataclasses.asdict(stats.geometry),
        "batches": stats.batches,
        "stacks": stacks,
        "tables": {
            name: {"ids": t.ids, "distinct_ids": t.distinct_ids, "top_ids": list(t.top_ids)}
            for name, t in stats.tables.items()
        },
    }


def _sparse_histogram(counts: np.ndarray) -> dict:
    """Only the values some partition took: the histogram is mostly zeros."""
    values = np.flatnonzero(counts.any(axis=0))
    return {"values": values.tolist(), "counts": counts[:, values].tolist()}


def _dense_histogram(entry: Mapping) -> np.ndarray:
    values = np.asarray(entry["values"], np.int64)
    counts = np.asarray(entry["counts"], np.int64).reshape(-1, values.size)
    dense = np.zeros((counts.shape[0], int(values.max(initial=-1)) + 1), np.int64)
    dense[:, values] = counts
    return dense


def _from_document(document: Any) -> FdoStats:
    if not isinstance(document, dict) or document.get("format") != FDO_STATS_FORMAT:
        raise ValueError(f"'format' is not {FDO_STATS_FORMAT!r}")
    if document["version"] != FDO_STATS_VERSION:
        raise ValueError(
            f"version {document['version']!r} is not the supported version "
            f"{FDO_STATS_VERSION}; recompute the stats with this sparseflow"
        )
    stacks = {
        name: StackFdoStats(
            **{field: entry[field] for field in _LIMIT_FIELDS},
            batch_max_percentiles=entry.get("batch_max_percentiles"),
            partition_histogram=(
                _dense_histogram(entry["partition_histogram"])
                if "partition_histogram" in entry
                else None
            ),
        )
        for name, entry in document["stacks"].items()
    }
    tables = {
        name: TableIdFrequency(
            ids=int(t["ids"]),
            distinct_ids=int(t["distinct_ids"]),
            top_ids=tuple((int(i), int(c)) for i, c in t["top_ids"]),
        )
        for name, t in document.get("tables", {}).items()
    }
    return FdoStats(
        config_hash=document["config_hash"],
        geometry=FdoGeometry(**document["geometry"]),
        batches=document["batches"],
        stacks=stacks,
        tables=tables,
    )


def merge_fdo_stats(stats: Sequence[FdoStats]) -> FdoStats:
    """Element-wise maxima of stats of one config and geometry.

    The offline summaries (percentiles, histograms, id frequencies) describe
    one job's batches and cannot be merged: they are kept when a single stats
    object is given and dropped otherwise.

    Raises:
      ValueError: no stats, or stats of different configs or geometries.
    """
    if not stats:
        raise ValueError("merge_fdo_stats: no stats to merge.")
    if len(stats) == 1:
        return stats[0]
    first = stats[0]
    for other in stats[1:]:
        if (other.config_hash, other.geometry) != (first.config_hash, first.geometry):
            raise ValueError(
                "Cannot merge FDO stats of different configs or geometries: "
                f"{first.config_hash[:12]} {first.geometry} vs "
                f"{other.config_hash[:12]} {other.geometry}."
            )
    names = list(dict.fromkeys(name for s in stats for name in s.stacks))
    stacks = {
        name: StackFdoStats(
            **{
                field: np.maximum.reduce(
                    [getattr(s.stacks[name], field) for s in stats if name in s.stacks]
                )
                for field in _LIMIT_FIELDS
            }
        )
        for name in names
    }
    batches = max(s.batches for s in stats)
    return FdoStats(
        config_hash=first.config_hash, geometry=first.geometry, batches=batches, stacks=stacks
    )


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
    path: str, stats: FdoStats, config_hash: str | None, geometry: FdoGeometry | None
) -> None:
    if config_hash is not None and stats.config_hash != config_hash:
        raise FdoStatsError(
            path,
            f"computed for config hash {stats.config_hash[:16]}..., expected "
            f"{config_hash[:16]}... (the config changed since); rerun `sparseflow fdo` "
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


def load_fdo_stats(
    path: str | os.PathLike,
    *,
    expected_config_hash: str | None,
    expected_geometry: FdoGeometry | None,
    on_mismatch: OnMismatch | str = OnMismatch.RAISE,
) -> FdoStats | None:
    """Loads a stats file, or merges the newest file of every source in a directory.

    Args:
      path: a stats file, or a directory of them (see `fdo_stats_file_name`).
      expected_config_hash: the run's config hash, or None to accept any.
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


def _load(path: str, config_hash: str | None, geometry: FdoGeometry | None) -> FdoStats:
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
        _check_expected(file, stats, config_hash, geometry)
        loaded.append(stats)
    try:
        return merge_fdo_stats(loaded)
    except ValueError as e:
        raise FdoStatsError(path, str(e)) from e


class FdoClient:
    """Records the online preprocessing's stats and shares them through files.

    Every process records the stats of its own batches, publishes them to
    its own file in a shared directory, and loads everyone's. Thread-safe.

    Example:
      client = FdoClient(directory, config_hash=h, geometry=g, process_index=i)
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
    ):
        if isinstance(process_index, bool) or not isinstance(process_index, int):
            raise TypeError(f"process_index must be an integer, got {process_index!r}.")
        if not 0 <= process_index < geometry.processes:
            raise ValueError(
                f"process_index {process_index} is outside [0, {geometry.processes}) "
                "(the geometry's processes)."
            )
        self.directory = os.fspath(directory)
        self.config_hash = config_hash
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
            name: {field: np.array(getattr(stats, field)[name]) for field in _LIMIT_FIELDS}
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

        See `load_fdo_stats`; files must match the client's config and geometry.
        """
        return load_fdo_stats(
            self.directory,
            expected_config_hash=self.config_hash,
            expected_geometry=self.geometry,
            on_mismatch=on_mismatch,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class StackLimits:
    """A stacked table's limits, as `StackedTableSpec` holds them.

    Attributes:
      max_ids_per_partition: entries per (slot, partition) and batch.
      max_unique_ids_per_partition: distinct ids per (slot, partition).
      suggested_coo_buffer_size_per_device: buffer entries per device, or
        None for the theoretical maximum.
    """

    max_ids_per_partition: int
    max_unique_ids_per_partition: int
    suggested_coo_buffer_size_per_device: int | None = None

    def __post_init__(self) -> None:
        _positive_int(self.max_ids_per_partition, "max_ids_per_partition")
        _positive_int(self.max_unique_ids_per_partition, "max_unique_ids_per_partition")
        if self.suggested_coo_buffer_size_per_device is not None:
            _positive_int(
                self.suggested_coo_buffer_size_per_device, "suggested_coo_buffer_size_per_device"
            )


def _scaled(value: int, headroom: fractions.Fraction) -> int:
    # Exact arithmetic: 100 * 1.1 in floats rounds up to 111.
    return max(1, math.ceil(value * headroom))


def _headroom(headroom: float) -> fractions.Fraction:
    if isinstance(headroom, bool) or not isinstance(headroom, int | float):
        raise TypeError(f"headroom must be a number, got {headroom!r}.")
    if not (math.isfinite(headroom) and headroom >= 1):
        raise ValueError(f"headroom must be a finite number >= 1 (e.g. 1.1), got {headroom!r}.")
    return fractions.Fraction(repr(float(headroom)))


def fdo_limits(stats: FdoStats, *, headroom: float = 1.1) -> dict[str, StackLimits]:
    """The limits the stats call for, per stacked table.

    `max_ids_per_partition` and `max_unique_ids_per_partition`: the maximum
    over partitions times `headroom`, rounded up; the buffer: the maximum
    required size of a partition slot times S times `headroom`, rounded up
    to a multiple of `8 * S` (as the layout needs).
    """
    factor = _headroom(headroom)
    slots = stats.geometry.partitions_per_device
    return {
        name: StackLimits(
            max_ids_per_partition=_scaled(int(stack.max_ids_per_partition.max()), factor),
            max_unique_ids_per_partition=_scaled(
                int(stack.max_unique_ids_per_partition.max()), factor
            ),
            suggested_coo_buffer_size_per_device=round_up(
                _scaled(int(stack.required_buffer_size_per_sc.max()) * slots, factor), 8 * slots
            ),
        )
        for name, stack in stats.stacks.items()
    }


def set_stack_limits(
    feature_specs: Nested,
    limits: Mapping[str, StackLimits],
    *,
    global_device_count: int,
    num_sc_per_device: int,
) -> Nested:
    """Prepared specs whose named stacked tables carry the given limits.

    Args:
      feature_specs: a pytree of `FeatureSpec` (prepared or not).
      limits: per stack name; stacks not named keep their limits.
      global_device_count: G, typically `mesh.size`.
      num_sc_per_device: S.

    Returns:
      The same pytree, prepared, with new `StackedTableSpec`s.

    Raises:
      ValueError: `limits` names a stack the specs do not have.
    """
    prepared = prepare_feature_specs_for_training(
        feature_specs, global_device_count, num_sc_per_device
    )
    stacks = get_stacked_table_specs(prepared)
    unknown = sorted(set(limits) - set(stacks))
    if unknown:
        raise ValueError(
            f"Limits for unknown stacked tables {unknown}; the specs have {sorted(stacks)}."
        )
    new = {
        name: dataclasses.replace(stacks[name], **dataclasses.asdict(limit))
        for name, limit in limits.items()
    }

    def replace(feature: FeatureSpec) -> FeatureSpec:
        stacked = new.get(feature.table_spec.stacked_table_spec.stack_name)
        if stacked is None:
            return feature
        table = dataclasses.replace(feature.table_spec, stacked_table_spec=stacked)
        return dataclasses.replace(feature, table_spec=table)

    return jax.tree.map(replace, prepared)


def apply_fdo(feature_specs: Nested, stats: FdoStats, *, headroom: float = 1.1) -> Nested:
    """Prepared specs with every stacked table's limits and buffer set from stats.

    Args:
      feature_specs: a pytree of `FeatureSpec` (prepared or not) of the run
        the stats were computed for.
      stats: e.g. from `load_fdo_stats` or `FdoClient.load`.
      headroom: factor >= 1 over the observed maxima (see `fdo_limits`).

    Returns:
      The same pytree, prepared for the stats' geometry, with new
      `StackedTableSpec`s (the inputs are not changed).

    Raises:
      ValueError: the stats' stacked tables differ from the specs'.

    Example:
      stats = embedding.load_fdo_stats(directory, expected_config_hash=h,
                                       expected_geometry=g)
      specs = embedding.apply_fdo(specs, stats, headroom=1.2)
    """
    geometry = stats.geometry
    prepared = prepare_feature_specs_for_training(
        feature_specs, geometry.devices, geometry.partitions_per_device
    )
    stacks = set(get_stacked_table_specs(prepared))
    if stacks != set(stats.stacks):
        raise ValueError(
            f"The FDO stats are for stacked tables {sorted(stats.stacks)}, the specs have "
            f"{sorted(stacks)}; recompute the stats for this config."
        )
    return set_stack_limits(
        prepared,
        fdo_limits(stats, headroom=headroom),
        global_device_count=geometry.devices,
        num_sc_per_device=geometry.partitions_per_device,
    )
