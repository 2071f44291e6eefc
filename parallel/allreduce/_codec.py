"""`AllReduceData` messages to and from plain values."""

from __future__ import annotations

import dataclasses

from parallel.allreduce import allreduce_pb2
from parallel.allreduce._values import ValueKind

_FIELD_OF_KIND = {ValueKind.BOOL: "bool_val", ValueKind.UINT64: "uint64_val"}
_KIND_OF_FIELD = {field: kind for kind, field in _FIELD_OF_KIND.items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Contribution:
    """One host's locally reduced value for a key, as sent to its peers."""

    sync_key: int
    src_rank: int
    kind: ValueKind
    value: int


def encode(contribution: Contribution, mac: bytes = b"") -> allreduce_pb2.AllReduceData:
    """The wire message of a contribution, with its HMAC if the group has a secret."""
    field = _FIELD_OF_KIND[contribution.kind]
    value = bool(contribution.value) if contribution.kind is ValueKind.BOOL else contribution.value
    return allreduce_pb2.AllReduceData(
        sync_key=contribution.sync_key, src_rank=contribution.src_rank, mac=mac, **{field: value}
    )


def decode(message: allreduce_pb2.AllReduceData, *, rank: int, world_size: int) -> Contribution:
    """The contribution a peer sent to host `rank` of a group of `world_size`.

    Raises:
      ValueError: the sender rank is out of range or the receiver's own, or
        no value is set.
    """
    src = message.src_rank
    if src >= world_size or src == rank:
        raise ValueError(
            f"src_rank {src} of sync key {message.sync_key} is not a peer of rank {rank}: "
            f"expected one of {[r for r in range(world_size) if r != rank]}."
        )
    field = message.WhichOneof("value")
    if field is None:
        raise ValueError(
            f"The message of rank {src} for sync key {message.sync_key} has no value: "
            "set bool_val or uint64_val."
        )
    return Contribution(
        sync_key=message.sync_key,
        src_rank=src,
        kind=_KIND_OF_FIELD[field],
        value=int(getattr(message, field)),
    )
