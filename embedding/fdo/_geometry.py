"""The batch geometry FDO stats are computed for, and the sizes and bounds it sets on them."""

from __future__ import annotations

import dataclasses

from embedding._buffers import INT32_MAX
from embedding._mesh_geometry import MeshGeometry
from embedding.checks import check_positive_int

LIMIT_FIELDS = (
    "max_ids_per_partition",
    "max_unique_ids_per_partition",
    "required_buffer_size_per_sc",
)
"""The per-partition stats, the ones the limits come from."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FdoGeometry(MeshGeometry):
    """The batch geometry stats are computed for; other geometries need other stats.

    Attributes:
      global_batch_size: B, examples per global batch, a multiple of N.
      devices, partitions_per_device, processes: the mesh (`MeshGeometry`);
        host h takes rows `[h*B/P, (h+1)*B/P)` of a batch.
    """

    global_batch_size: int

    def __post_init__(self) -> None:
        check_positive_int(self.global_batch_size, "FdoGeometry.global_batch_size")
        super().__post_init__()
        if self.global_batch_size % self.num_partitions:
            raise ValueError(
                f"FdoGeometry: global_batch_size {self.global_batch_size} must be a "
                f"multiple of devices x partitions_per_device = {self.num_partitions}."
            )


def stat_sizes(geometry: FdoGeometry) -> dict[str, int]:
    """The length of every stat in `LIMIT_FIELDS`: `L * N` per partition, `L * S` per slot."""
    per_partition = geometry.local_devices * geometry.num_partitions
    return {
        "max_ids_per_partition": per_partition,
        "max_unique_ids_per_partition": per_partition,
        "required_buffer_size_per_sc": geometry.local_devices * geometry.partitions_per_device,
    }


def largest_slot_buffer(geometry: FdoGeometry) -> int:
    """The largest buffer one partition slot may require, a multiple of 8.

    The layout pads every partition's segment to 8 entries, and a device's S
    slots together must stay within the int32 indices of the layout and
    the lookup.
    """
    return INT32_MAX // geometry.partitions_per_device // 8 * 8
