"""FDO (feedback-directed optimization) stats: what they hold and their file format.

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
job (see `embedding._fdo_client` for writing, loading and merging them).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from embedding._specs import check_positive_int
from embedding._stacking import check_partition_count

FDO_STATS_FORMAT = "sparseflow.fdo_stats"
FDO_STATS_VERSION = 1
LIMIT_FIELDS = (
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
            check_positive_int(getattr(self, field.name), f"FdoGeometry.{field.name}")
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
        for name in LIMIT_FIELDS:
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
        entry = {field: getattr(stack, field).tolist() for field in LIMIT_FIELDS}
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
            **{field: entry[field] for field in LIMIT_FIELDS},
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
