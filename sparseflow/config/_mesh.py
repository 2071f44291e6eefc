"""The config's `mesh` section and `global_batch_size`.

`mesh.devices` is an integer or `auto`: the devices JAX sees (over every
process of a run), asked when the config is loaded. The command line's
`--devices N` takes its place. Messages about a count that did not come
from the config's own integer say where it came from.
"""

from __future__ import annotations

import dataclasses

import jax

import embedding
from embedding.checks import check_positive_int
from sparseflow.config._checker import Node, integer, mapping, type_name

AUTO = "auto"
MESH_KEYS = (("devices", "partitions_per_device"), ("processes",))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig(embedding.MeshGeometry):
    """The config's `mesh` section: the run's `embedding.MeshGeometry`."""


@dataclasses.dataclass(frozen=True)
class DeviceCount:
    """A run's device count, and where it came from.

    Attributes:
      count: devices over all processes.
      origin: how the count was chosen when the config's `mesh.devices` does
        not name it, e.g. "mesh.devices: auto resolved to 6 devices, the
        devices JAX sees" or "--devices 8 in place of mesh.devices: auto";
        None when it does.
    """

    count: int
    origin: str | None = None

    def __post_init__(self) -> None:
        check_positive_int(self.count, "devices")

    def suffix(self) -> str:
        """` (origin)` for a message about the count, or nothing."""
        return "" if self.origin is None else f" ({self.origin})"


def devices_noun(count: int) -> str:
    return f"{count} device" if count == 1 else f"{count} devices"


def written_devices(node: Node) -> int | str:
    """The mesh's `devices` as the file writes it: an integer >= 1, or `AUTO`."""
    mapping(node, *MESH_KEYS)
    value = node.value["devices"]
    if value == AUTO or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise node.child("devices").error(
        f"expected an integer >= 1 or {AUTO!r}, got {type_name(value)} {value!r}"
    )


def devices_jax_sees() -> DeviceCount:
    """`auto` resolved: the devices JAX sees over every process (this starts JAX's backend)."""
    count, processes = jax.device_count(), jax.process_count()
    over = f" over {processes} processes" if processes > 1 else ""
    return DeviceCount(
        count, f"mesh.devices: {AUTO} resolved to {devices_noun(count)}, the devices JAX sees{over}"
    )


def read_mesh(
    node: Node, devices: int | DeviceCount | None = None
) -> tuple[MeshConfig, DeviceCount]:
    """The mesh, and its device count with where it came from.

    Args:
      node: the `mesh` section.
      devices: the count to use in place of the section's `devices`; None:
        the section's integer, or the devices JAX sees for `auto`.
    """
    written = written_devices(node)
    if devices is None:
        devices = devices_jax_sees() if written == AUTO else DeviceCount(written)
    elif not isinstance(devices, DeviceCount):
        devices = DeviceCount(devices, f"{devices} given in place of mesh.devices: {written}")
    partitions, processes = integer(node, "partitions_per_device"), integer(node, "processes", 1)
    try:
        mesh = MeshConfig(
            devices=devices.count, partitions_per_device=partitions, processes=processes
        )
    except (ValueError, TypeError) as e:
        raise node.error(f"{e}{devices.suffix()}") from e
    return mesh, devices


def read_global_batch_size(root: Node, mesh: MeshConfig, devices: DeviceCount) -> int:
    batch = integer(root, "global_batch_size")
    if batch % mesh.num_partitions:
        raise root.child("global_batch_size").error(
            f"{batch} is not divisible by devices x partitions_per_device = "
            f"{mesh.num_partitions}; every partition slot takes an equal share{devices.suffix()}"
        )
    return batch
