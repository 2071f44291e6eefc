"""The device mesh every part of a run shares: G devices over P hosts, S partitions each."""

from __future__ import annotations

import dataclasses

from embedding.checks import check_positive_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshGeometry:
    """G devices over P processes (hosts), S embedding partitions per device.

    The one definition of the mesh's counts and their rules: the config's
    `mesh` section and the geometry FDO stats are computed for are both one.

    Attributes:
      devices: G, devices over all hosts.
      partitions_per_device: S, embedding partitions ("sparse cores") per device.
      processes: P, hosts (one process each); each holds `G / P` devices.

    Raises:
      TypeError, ValueError: a count is not a positive integer, N = G * S is not
        a power of two (the layout picks an id's partition as `id & (N - 1)`),
        or P does not divide G.
    """

    devices: int
    partitions_per_device: int
    processes: int = 1

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in ("devices", "partitions_per_device", "processes"):
            check_positive_int(getattr(self, name), f"{owner}.{name}")
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
        """L = G / P, devices of one host."""
        return self.devices // self.processes
