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
    "layout": {"<entry>": <string, integer,      # optional: what the stats
               bool or list of integers>},       # depend on (`embedding.FdoLayout`)
    "batch_order": {"records": R,                # optional, offline job only: the
                    "shuffle_seed": int or null, # stats cover exactly the batches
                    "epochs": E},                # of this order (`FdoBatchOrder`)
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

Reading is strict; a file that breaks any of these rules is refused with an
`FdoStatsError` naming the file and the entry (`stacks['t'].max_ids_per_partition[3]`):
- no entry outside the format above, none of its required entries missing;
- every number a non-negative integer (not `true`, not `2.0`); the stats,
  percentiles and histogram values at most 2**31 - 1, histogram counts at
  most `batches`;
- a slot's buffer a multiple of 8, and the S buffers of a device together
  within the int32 indices of the layout (at most `(2**31 - 1) // S`);
- a partition's max ids at most the largest buffer of its device's slots,
  its max distinct ids at most its max ids;
- percentiles in order, `max` the largest value of the stat;
- histogram values increasing, none above the stack's max ids, every
  partition counting each batch once, and the dense histogram (N x the
  largest value + 1) at most 2**27 counts.

Files are named `fdo_stats-<source>-<time_ns>.json`, `<source>` being
`p<process index, 5 digits>` for `FdoClient` and `offline` for the offline
job (see `embedding.fdo._client` for writing, loading and merging them).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from embedding._buffers import INT32_MAX
from embedding._errors import SparseflowError
from embedding.checks import check_int
from embedding.fdo._batch_order import FdoBatchOrder
from embedding.fdo._geometry import LIMIT_FIELDS, FdoGeometry, stat_sizes
from embedding.fdo._invariants import BATCH_MAX_PERCENTILES, check_stack
from embedding.fdo._schema import (
    INT64_MAX,
    SchemaError,
    field,
    integer,
    integers,
    item,
    json_list,
    json_object,
)

FDO_STATS_FORMAT = "sparseflow.fdo_stats"
FDO_STATS_VERSION = 1
# A dense histogram is N x (largest value + 1) int64 counts; beyond 1 GiB a
# file is refused before anything is allocated (the job that wrote it would
# have held as much).
_MAX_HISTOGRAM_CELLS = 2**27


class FdoStatsError(SparseflowError, ValueError):
    """A stats file (or directory) that is missing, corrupt or for another run.

    Attributes:
      path: the file or directory.
    """

    def __init__(self, path: str | os.PathLike, message: str):
        super().__init__(f"{os.fspath(path)}: {message}")
        self.path = os.fspath(path)


def _checked_array(values: Any, name: str, dtype: type[np.integer]) -> np.ndarray:
    """`values` as `dtype`, refusing what the cast would truncate or wrap."""
    array = np.asarray(values)
    if array.dtype.kind not in "iu":
        raise SchemaError(name, f"must be integers, got {array.dtype} values")
    high = np.iinfo(dtype).max
    i = np.flatnonzero((array < 0) | (array > high))
    if i.size:
        raise SchemaError(item(name, int(i[0])), f"must be in [0, {high}], got {array.flat[i[0]]}")
    return array.astype(dtype)


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

    Raises:
      ValueError: a value that is not a non-negative integer of the
        attribute's dtype.
    """

    max_ids_per_partition: np.ndarray
    max_unique_ids_per_partition: np.ndarray
    required_buffer_size_per_sc: np.ndarray
    batch_max_percentiles: Mapping[str, Mapping[str, int]] | None = None
    partition_histogram: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name in LIMIT_FIELDS:
            object.__setattr__(self, name, _checked_array(getattr(self, name), name, np.int32))
        if self.partition_histogram is not None:
            histogram = _checked_array(self.partition_histogram, "partition_histogram", np.int64)
            object.__setattr__(self, "partition_histogram", histogram)


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
      layout: what the stats depend on (`FdoLayout.entries`; may be empty):
        a run of the same layout may use them, and a mismatch names the
        entries that changed.
      batch_order: the batches the stats cover exactly, when they are those
        of a run's input order (offline job), else None (file-order batches
        of unknown relation to the run's, or online stats).

    Raises:
      ValueError: stats of another shape than the geometry's, or that
        contradict each other (see `embedding.fdo._invariants`); the message
        names the entry, e.g. `stacks['t'].max_ids_per_partition[3]`.
    """

    config_hash: str
    geometry: FdoGeometry
    batches: int
    stacks: Mapping[str, StackFdoStats]
    tables: Mapping[str, TableIdFrequency] = dataclasses.field(default_factory=dict)
    layout: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    batch_order: FdoBatchOrder | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.config_hash, str):
            raise TypeError(f"config_hash must be a string, got {self.config_hash!r}.")
        check_int(self.batches, "batches", 0)
        for name, stack in self.stacks.items():
            arrays = {f.name: getattr(stack, f.name) for f in dataclasses.fields(stack)}
            check_stack(item("stacks", name), self.geometry, self.batches, **arrays)

    def to_json(self) -> str:
        """The stats as the text of a stats file."""
        return json.dumps(_to_document(self), separators=(",", ":")) + "\n"

    @classmethod
    def from_json(cls, text: str, *, source: str | os.PathLike = "<text>") -> FdoStats:
        """Parses the text of a stats file, strictly (see the module docstring).

        Raises:
          FdoStatsError: not a stats file of a known version, or an entry of
            the wrong type or out of bounds; names `source` and the entry.
        """
        try:
            document = json.loads(text)
        except RecursionError as e:
            raise FdoStatsError(source, "corrupt FDO stats file: nested too deeply.") from e
        # ValueError too: an integer of more digits than Python converts.
        except ValueError as e:
            raise FdoStatsError(source, f"corrupt FDO stats file (not JSON: {e}).") from e
        try:
            return _from_document(document)
        except ValueError as e:
            raise FdoStatsError(source, f"corrupt FDO stats file: {e}") from e


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
        **({"layout": dict(stats.layout)} if stats.layout else {}),
        **(
            {"batch_order": dataclasses.asdict(stats.batch_order)}
            if stats.batch_order is not None
            else {}
        ),
    }


def _sparse_histogram(counts: np.ndarray) -> dict:
    """Only the values some partition took: the histogram is mostly zeros."""
    values = np.flatnonzero(counts.any(axis=0))
    return {"values": values.tolist(), "counts": counts[:, values].tolist()}


def _from_document(document: Any) -> FdoStats:
    root = json_object(document, "")
    if root.get("format") != FDO_STATS_FORMAT:
        raise SchemaError("format", f"must be {FDO_STATS_FORMAT!r}, got {root.get('format')!r}")
    # Checked before the other entries: another version may have other ones.
    version = root.get("version")
    if type(version) is not int or version != FDO_STATS_VERSION:
        raise SchemaError(
            "version",
            f"{version!r} is not the supported version {FDO_STATS_VERSION}; recompute the "
            "stats with this sparseflow",
        )
    required = ("format", "version", "config_hash", "geometry", "batches", "stacks")
    json_object(root, "", required=required, optional=("tables", "layout", "batch_order"))
    if not isinstance(root["config_hash"], str):
        raise SchemaError("config_hash", f"must be a string, got {root['config_hash']!r}")
    geometry = _geometry(root["geometry"])
    batches = integer(root["batches"], "batches", high=INT64_MAX)
    stacks = json_object(root["stacks"], "stacks")
    tables = json_object(root.get("tables", {}), "tables")
    return FdoStats(
        config_hash=root["config_hash"],
        geometry=geometry,
        batches=batches,
        stacks={
            name: _stack(s, item("stacks", name), geometry, batches) for name, s in stacks.items()
        },
        tables={name: _table(t, item("tables", name)) for name, t in tables.items()},
        layout=_layout(root.get("layout", {})),
        batch_order=None if "batch_order" not in root else _batch_order(root["batch_order"]),
    )


def _batch_order(value: Any) -> FdoBatchOrder:
    fields = json_object(value, "batch_order", required=("records", "shuffle_seed", "epochs"))
    seed = fields["shuffle_seed"]
    return FdoBatchOrder(
        records=integer(fields["records"], "batch_order.records", high=INT64_MAX),
        shuffle_seed=None
        if seed is None
        else integer(seed, "batch_order.shuffle_seed", high=2**32 - 1),
        epochs=integer(fields["epochs"], "batch_order.epochs", high=INT64_MAX),
    )


def _layout(value: Any) -> dict[str, Any]:
    entries = json_object(value, "layout")
    for name, entry in entries.items():
        scalar = isinstance(entry, str | int)  # bools are ints
        listed = isinstance(entry, list) and all(type(v) is int for v in entry)
        if not (scalar or listed):
            raise SchemaError(
                item("layout", name),
                f"must be a string, integer, bool or list of integers, got {entry!r}",
            )
    return entries


def _geometry(value: Any) -> FdoGeometry:
    names = [f.name for f in dataclasses.fields(FdoGeometry)]
    fields = json_object(value, "geometry", required=names)
    try:
        return FdoGeometry(**fields)
    except ValueError as e:
        raise SchemaError("geometry", str(e)) from e


def _stack(value: Any, entry: str, geometry: FdoGeometry, batches: int) -> StackFdoStats:
    fields = json_object(
        value,
        entry,
        required=LIMIT_FIELDS,
        optional=("batch_max_percentiles", "partition_histogram"),
    )
    stats = {
        name: integers(fields[name], field(entry, name), high=INT32_MAX, length=size)
        for name, size in stat_sizes(geometry).items()
    }
    percentiles = fields.get("batch_max_percentiles")
    if percentiles is not None:
        percentiles = _percentiles(percentiles, field(entry, "batch_max_percentiles"))
    histogram = fields.get("partition_histogram")
    if histogram is not None:
        largest = max(stats["max_ids_per_partition"], default=0)
        histogram = _histogram(
            histogram,
            field(entry, "partition_histogram"),
            geometry.num_partitions,
            largest,
            batches,
        )
    return StackFdoStats(**stats, batch_max_percentiles=percentiles, partition_histogram=histogram)


def _percentiles(value: Any, entry: str) -> dict[str, dict[str, int]]:
    per_stat = json_object(value, entry, optional=LIMIT_FIELDS)
    return {
        stat: {
            q: integer(v, item(item(entry, stat), q), high=INT32_MAX)
            for q, v in json_object(p, item(entry, stat), required=BATCH_MAX_PERCENTILES).items()
        }
        for stat, p in per_stat.items()
    }


def _histogram(value: Any, entry: str, partitions: int, largest: int, batches: int) -> np.ndarray:
    """The dense `int64[N, largest value + 1]` histogram, its size checked before it exists."""
    fields = json_object(value, entry, required=("values", "counts"))
    values_entry = field(entry, "values")
    values = integers(fields["values"], values_entry, high=INT32_MAX)
    for i in range(1, len(values)):
        if values[i] <= values[i - 1]:
            raise SchemaError(
                item(values_entry, i),
                f"{values[i]} does not follow {values[i - 1]} in increasing order",
            )
    if values and values[-1] > largest:
        raise SchemaError(
            item(values_entry, len(values) - 1),
            f"{values[-1]} exceeds the largest max_ids_per_partition, {largest}",
        )
    width = values[-1] + 1 if values else 0
    if partitions * width > _MAX_HISTOGRAM_CELLS:
        raise SchemaError(
            entry,
            f"{partitions} partitions x {width} values make more than the "
            f"{_MAX_HISTOGRAM_CELLS} counts a histogram may hold",
        )
    counts_entry = field(entry, "counts")
    rows = json_list(fields["counts"], counts_entry, length=partitions, of="lists")
    dense = np.zeros((partitions, width), np.int64)
    for p, row in enumerate(rows):
        dense[p, values] = integers(row, item(counts_entry, p), high=batches, length=len(values))
    return dense


def _table(value: Any, entry: str) -> TableIdFrequency:
    fields = json_object(value, entry, required=("ids", "distinct_ids", "top_ids"))
    top_entry = field(entry, "top_ids")
    pairs = json_list(fields["top_ids"], top_entry, of="[id, count] pairs")
    return TableIdFrequency(
        ids=integer(fields["ids"], field(entry, "ids"), high=INT64_MAX),
        distinct_ids=integer(fields["distinct_ids"], field(entry, "distinct_ids"), high=INT64_MAX),
        top_ids=tuple(
            tuple(integers(pair, item(top_entry, i), high=INT64_MAX, length=2))
            for i, pair in enumerate(pairs)
        ),
    )
