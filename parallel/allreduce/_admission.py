"""Which peer streams a server keeps open: one per rank, few of unknown origin.

Every open `ContributeStream` holds one server thread. A stream belongs to a
rank once it is authenticated (its client certificate, or its first message
that passes the checks); until then it is *unidentified*. Limits, so that
streams nobody needs cannot take the threads the genuine peers need:

* at most one stream per rank: a newer one replaces (cancels) the older, as
  a peer that reconnects after a broken connection needs;
* at most `unidentified_limit` unidentified streams: a new one cancels the
  oldest, so idle streams of a stranger give way to a peer that connects
  later and identifies itself with its first message.

Locking: `_lock` guards the bookkeeping and is never held while a stream is
cancelled (a call into gRPC).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

_log = logging.getLogger(__name__)


class PeerStreamSlot:
    """One open stream: whose it is (None: not known yet) and how to end it."""

    __slots__ = ("rank", "_cancel")

    def __init__(self, cancel: Callable[[], None], rank: int | None):
        self.rank = rank
        self._cancel = cancel

    def cancel(self) -> None:
        self._cancel()


class StreamRegistry:
    """The open streams of one server.

    Args:
      unidentified_limit: unidentified streams kept open at once.
    """

    def __init__(self, unidentified_limit: int):
        if unidentified_limit < 1:
            raise ValueError(f"unidentified_limit must be >= 1, got {unidentified_limit}.")
        self._limit = unidentified_limit
        self._lock = threading.Lock()
        self._unidentified: collections.OrderedDict[PeerStreamSlot, None] = (
            collections.OrderedDict()
        )
        self._by_rank: dict[int, PeerStreamSlot] = {}
        self._ended = 0

    @property
    def ended(self) -> int:
        """Streams this server cancelled: replaced, or pushed out while unidentified."""
        with self._lock:
            return self._ended

    def open(self, cancel: Callable[[], None], rank: int | None = None) -> PeerStreamSlot:
        """Registers a new stream; cancels the one it replaces or pushes out."""
        slot = PeerStreamSlot(cancel, None)
        with self._lock:
            if rank is None:
                self._unidentified[slot] = None
                pushed_out = None
                if len(self._unidentified) > self._limit:
                    pushed_out, _ = self._unidentified.popitem(last=False)
                    self._ended += 1
            else:
                pushed_out = self._claim_locked(slot, rank)
        if rank is None:
            self._end(pushed_out, "pushed out by a newer unidentified stream", logging.DEBUG)
        else:
            self._end(pushed_out, "replaced by the rank's newer stream", logging.INFO)
        return slot

    def identify(self, slot: PeerStreamSlot, rank: int) -> None:
        """Records that `slot` is rank `rank`'s stream; cancels its older one."""
        with self._lock:
            if slot not in self._unidentified:
                return  # pushed out meanwhile: it ends, and must not displace a live one
            del self._unidentified[slot]
            replaced = self._claim_locked(slot, rank)
        self._end(replaced, "replaced by the rank's newer stream", logging.INFO)

    def close(self, slot: PeerStreamSlot) -> None:
        """Forgets a stream that ended."""
        with self._lock:
            self._unidentified.pop(slot, None)
            if slot.rank is not None and self._by_rank.get(slot.rank) is slot:
                del self._by_rank[slot.rank]

    def _claim_locked(self, slot: PeerStreamSlot, rank: int) -> PeerStreamSlot | None:
        slot.rank = rank
        older = self._by_rank.get(rank)
        self._by_rank[rank] = slot
        if older is not None:
            self._ended += 1
        return older

    @staticmethod
    def _end(slot: PeerStreamSlot | None, why: str, level: int) -> None:
        # Push-outs are what a flood of streams causes: logged below INFO so
        # that a stranger cannot flood the log too; `ended` counts them.
        if slot is None:
            return
        _log.log(level, "all-reduce: ending a stream (rank %s): %s", slot.rank, why)
        slot.cancel()
