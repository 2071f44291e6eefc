"""The stats of one global batch, from the online preprocessing itself.

Every host's rows of the batch go through
`embedding.preprocess_sparse_dense_matmul_input` as the online pipeline sends
them (local devices `G / P`), and its stats (counted before any dropping) are
kept. Dropping is allowed and the limits are small, so the layout's buffers
stay small whatever the data: the stats do not depend on the limits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

import embedding
from beam_jobs._batches import SparseRows, host_rows

# Small limits keep the layout's buffers (`roundup8(limit) * S * N` per
# device) small; the stats are counted before dropping.
_STATS_LIMITS = embedding.StackLimits(max_ids_per_partition=8, max_unique_ids_per_partition=8)
STAT_FIELDS = (
    "max_ids_per_partition",
    "max_unique_ids_per_partition",
    "required_buffer_size_per_sc",
)


class BatchStats(NamedTuple):
    """One global batch's stats.

    Attributes:
      batch: the batch number.
      stacks: per stacked table and stat field (`STAT_FIELDS`), the
        element-wise max over hosts: `int32[L * N]` for the ids and unique
        ids per partition, `int32[L * S]` for the required buffer.
      id_counts: per logical table, its distinct ids in the batch
        (`int64[k]`, sorted) and how often each occurs (`int64[k]`).
    """

    batch: int
    stacks: dict[str, dict[str, np.ndarray]]
    id_counts: dict[str, tuple[np.ndarray, np.ndarray]]


class BatchStatsComputer:
    """Computes `BatchStats` for the batches of one run.

    Args:
      feature_specs: per feature (its record key), its spec, stacked as the run's.
      geometry: the batch geometry.
    """

    def __init__(
        self, feature_specs: Mapping[str, embedding.FeatureSpec], geometry: embedding.FdoGeometry
    ):
        self.geometry = geometry
        prepared = embedding.prepare_feature_specs_for_training(
            dict(feature_specs), geometry.devices, geometry.partitions_per_device
        )
        stacks = embedding.get_stacked_table_specs(prepared)
        self._specs = embedding.set_stack_limits(
            prepared,
            dict.fromkeys(stacks, _STATS_LIMITS),
            global_device_count=geometry.devices,
            num_sc_per_device=geometry.partitions_per_device,
        )
        self._features_of_table: dict[str, list[str]] = {}
        for name, spec in prepared.items():
            self._features_of_table.setdefault(spec.table_spec.name, []).append(name)

    def __call__(self, batch: int, rows: SparseRows) -> BatchStats:
        """The stats of global batch number `batch` (`rows`: its B rows)."""
        g = self.geometry
        if rows.num_rows != g.global_batch_size:
            raise ValueError(
                f"Batch {batch} has {rows.num_rows} rows, expected the global batch "
                f"{g.global_batch_size}."
            )
        per_host = [self._host_stats(host_rows(rows, h, g.processes)) for h in range(g.processes)]
        stacks = {
            name: {
                field: np.maximum.reduce([getattr(s, field)[name] for s in per_host])
                for field in STAT_FIELDS
            }
            for name in per_host[0].max_ids_per_partition
        }
        return BatchStats(batch, stacks, self._id_counts(rows))

    def _host_stats(self, rows: SparseRows) -> embedding.SparseDenseMatmulInputStats:
        g = self.geometry
        names = list(self._specs)
        _, stats = embedding.preprocess_sparse_dense_matmul_input(
            {name: rows.ids[name] for name in names},
            {name: rows.weights.get(name) for name in names} if rows.weights else None,
            self._specs,
            local_device_count=g.local_devices,
            global_device_count=g.devices,
            num_sc_per_device=g.partitions_per_device,
            allow_id_dropping=True,
        )
        return stats

    def _id_counts(self, rows: SparseRows) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        counts = {}
        for table, features in self._features_of_table.items():
            ids = np.concatenate([rows.ids[name].values for name in features])
            counts[table] = np.unique(ids.astype(np.int64), return_counts=True)
        return counts
