"""The config's `mesh` section and `global_batch_size`."""

from __future__ import annotations

import dataclasses

from embedding._checks import check_positive_int
from sparseflow._config_checker import Node, build, integer, mapping


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """The device mesh.

    Attributes:
      devices: G, devices over all hosts.
      partitions_per_device: S, embedding partitions ("sparse cores") per device.
      processes: hosts (one process each); each holds `devices / processes`.
    """

    devices: int
    partitions_per_device: int
    processes: int = 1

    def __post_init__(self) -> None:
        for name in ("devices", "partitions_per_device", "processes"):
            check_positive_int(getattr(self, name), name)
        n = self.num_partitions
        if n & (n - 1):
            raise ValueError(
                f"devices ({self.devices}) x partitions_per_device "
                f"({self.partitions_per_device}) = {n} partitions; this must be a power of two"
            )
        if self.devices % self.processes:
            raise ValueError(
                f"{self.processes} processes cannot share {self.devices} devices evenly"
            )

    @property
    def num_partitions(self) -> int:
        """N = G * S, a power of two."""
        return self.devices * self.partitions_per_device

    @property
    def local_devices(self) -> int:
        """Devices of one host."""
        return self.devices // self.processes


def read_mesh(node: Node) -> MeshConfig:
    mapping(node, ("devices", "partitions_per_device"), ("processes",))
    return build(
        node,
        MeshConfig,
        dict(
            devices=integer(node, "devices"),
            partitions_per_device=integer(node, "partitions_per_device"),
            processes=integer(node, "processes", 1),
        ),
    )


def read_global_batch_size(root: Node, mesh: MeshConfig) -> int:
    batch = integer(root, "global_batch_size")
    if batch % mesh.num_partitions:
        raise root.child("global_batch_size").error(
            f"{batch} is not divisible by devices x partitions_per_device = "
            f"{mesh.num_partitions}; every partition slot takes an equal share"
        )
    return batch
