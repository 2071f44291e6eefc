"""Interfaces shared by the node, its interface object and the lazy wrapper."""

from __future__ import annotations

import dataclasses
from typing import Protocol


class AllReduceInterface(Protocol):
    """Cross-host OR agreement, as the preprocessing calls it.

    Every host (and each of its K local contributors) calls a method with the
    same key for the same round; every call returns the OR over all of them.
    The preprocessing uses key `2 * batch` for the minibatching flag and
    `2 * batch + 1` for the split mask.
    """

    def all_reduce_bool(self, sync_key: int, value: bool) -> bool: ...

    def all_reduce_uint64(self, sync_key: int, value: int) -> int: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllReduceStats:
    """Counters of one node since it was created.

    Attributes:
      completed: keys reduced successfully.
      failed: keys that ended in an error (timeout, peer error, close).
      pending: keys started and not finished yet.
      late_ignored: peer messages for keys already finished (ignored).
      duplicates_ignored: repeated peer messages for a pending key (ignored).
      rejected: peer messages answered with INVALID_ARGUMENT.
      send_failures: sends to a peer that finally failed.
    """

    completed: int
    failed: int
    pending: int
    late_ignored: int
    duplicates_ignored: int
    rejected: int
    send_failures: int
