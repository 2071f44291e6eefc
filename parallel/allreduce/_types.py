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
      rejected: peer messages answered with INVALID_ARGUMENT (malformed, the
        other value kind, or a new key out of bounds).
      auth_failed: peer messages dropped because their HMAC, certificate or
        stream did not match the rank they claimed; never recorded.
      expired: keys only peers had started, forgotten after the deadline.
      streams_ended: peer streams the server ended (replaced by the rank's
        newer stream, or unidentified and pushed out by a newer one).
      send_failures: sends to a peer that finally failed.
    """

    completed: int
    failed: int
    pending: int
    late_ignored: int
    duplicates_ignored: int
    rejected: int
    auth_failed: int
    expired: int
    streams_ended: int
    send_failures: int
