"""Errors raised to the threads that wait on an all-reduce."""

from __future__ import annotations


class AllReduceError(RuntimeError):
    """An all-reduce round could not produce the agreed value.

    Attributes:
      sync_key: the key of the failed round.
      rank: the rank of the host that raised the error.
    """

    def __init__(self, message: str, *, sync_key: int, rank: int):
        super().__init__(message)
        self.sync_key = sync_key
        self.rank = rank


class AllReduceTimeoutError(AllReduceError):
    """Some contributions of a key did not arrive within the deadline.

    Attributes:
      missing_ranks: peer ranks whose value never arrived, ascending.
      missing_local: local contributions that never arrived.
      elapsed_s: seconds the raising thread waited.
    """

    def __init__(
        self,
        message: str,
        *,
        sync_key: int,
        rank: int,
        missing_ranks: tuple[int, ...],
        missing_local: int,
        elapsed_s: float,
    ):
        super().__init__(message, sync_key=sync_key, rank=rank)
        self.missing_ranks = missing_ranks
        self.missing_local = missing_local
        self.elapsed_s = elapsed_s


class AllReducePeerError(AllReduceError):
    """A peer rejected this host's value, or sent a value of the wrong type.

    Attributes:
      peer_rank: the rank of the peer involved.
    """

    def __init__(self, message: str, *, sync_key: int, rank: int, peer_rank: int):
        super().__init__(message, sync_key=sync_key, rank=rank)
        self.peer_rank = peer_rank


class AllReduceClosedError(AllReduceError):
    """The node was closed while the key was still being reduced."""


class UnauthenticatedError(Exception):
    """A peer message failed authentication; it is dropped, never recorded.

    Raised by a node's receive path to its servicer only, which answers with
    UNAUTHENTICATED (unary) or a rejection reply (stream).
    """
