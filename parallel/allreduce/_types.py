"""Interfaces shared by the node, its interface object and the lazy wrapper.

`AllReduceInterface` is defined where the preprocessing calls it
(`embedding`, which imports nothing from `parallel`) and re-exported here.
"""

from __future__ import annotations

import dataclasses

from embedding import AllReduceInterface

__all__ = ["AllReduceInterface", "AllReduceStats"]


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
