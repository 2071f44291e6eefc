"""The per-key reduction state of one host, without any networking.

A key is pending from its first event (a local contribution, a peer message or
a `wait`) until all K local contributions and the values of all N-1 peers are
in (then it holds the OR of all of them), or until it fails. A finished key
moves to a window of the `finished_window` most recent finished keys, so that
late and repeated peer messages for it are recognized and ignored.

Keys that only peers have started (no local contribution or waiter yet) are
bounded, so that a peer cannot grow the table without limit: a new one is
rejected when it lies more than `key_window` keys from this host's latest
local key or when `pending_limit` of them are pending already, and one
expires (is forgotten, its values with it) `deadline_s` after it started:
by then the senders' own deadlines have passed.

Locking: one lock guards all state; every key's condition variable is built on
it, so there is no lock order to respect inside this module. Callers must not
hold any other lock of theirs while calling in (the node never does).
"""

from __future__ import annotations

import collections
import enum
import threading
import time
from collections.abc import Callable, Sequence

from parallel.allreduce._codec import Contribution
from parallel.allreduce._errors import (
    AllReduceClosedError,
    AllReduceError,
    AllReducePeerError,
    AllReduceTimeoutError,
)
from parallel.allreduce._values import ValueKind

ErrorFactory = Callable[[], AllReduceError]


class PeerOutcome(enum.Enum):
    """What became of a peer's message."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    LATE = "late"


class _Key:
    """One key's state; every field is guarded by the table's lock."""

    __slots__ = ("kind", "local", "peers", "local_left", "peers_in", "done", "result", "error")

    def __init__(self, local_contributors: int, lock: threading.Lock):
        self.kind: ValueKind | None = None
        self.local = 0
        self.peers = 0
        self.local_left = local_contributors
        self.peers_in: set[int] = set()
        self.done = threading.Condition(lock)
        self.result: int | None = None
        # A factory, not an instance: every waiting thread raises its own
        # exception object, so tracebacks of different threads never mix.
        self.error: ErrorFactory | None = None

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None


class ReductionTable:
    """OR-reduction of K local and N-1 peer values per sync key.

    Args:
      rank: this host's rank.
      peers: "host:port" of every host in rank order (named in errors).
      local_contributors: K.
      deadline_s: how long `wait` blocks before failing the key.
      finished_window: how many finished keys are remembered.
      pending_limit: keys only peers have started, at most.
      key_window: how far from this host's latest local key a peer may
        start a key.
    """

    def __init__(
        self,
        *,
        rank: int,
        peers: Sequence[str],
        local_contributors: int,
        deadline_s: float,
        finished_window: int,
        pending_limit: int,
        key_window: int,
    ):
        self._rank = rank
        self._peers = tuple(peers)
        self._k = local_contributors
        self._deadline_s = deadline_s
        self._window = finished_window
        self._pending_limit = pending_limit
        self._key_window = key_window
        self._lock = threading.Lock()
        self._pending: dict[int, _Key] = {}
        # Keys only peers have started -> when, oldest first.
        self._peer_only: dict[int, float] = {}
        self._last_local: int | None = None
        self._finished: collections.OrderedDict[int, _Key] = collections.OrderedDict()
        self._closed = False
        self._counts = collections.Counter()

    def add_local(self, sync_key: int, kind: ValueKind, value: int) -> int | None:
        """Adds one local contribution.

        Returns:
          The host's locally reduced value if this was the K-th local
          contribution (the caller sends it to the peers), else None.

        Raises:
          TypeError: the key already holds values of the other kind.
          ValueError: the key already had its K local contributions.
          AllReduceError: the key already failed, or the table is closed.
        """
        with self._lock:
            state = self._local_state(sync_key)
            self._last_local = sync_key
            if state.finished:
                raise self._finished_error(sync_key, state)
            if state.kind not in (None, kind):
                raise TypeError(
                    f"sync key {sync_key} holds {state.kind.value} values; got a "
                    f"{kind.value} value. Use one kind (bool or uint64) per key."
                )
            if state.local_left == 0:
                raise ValueError(self._extra_local_message(sync_key))
            state.kind = kind
            state.local |= value
            state.local_left -= 1
            self._finish_if_complete(sync_key, state)
            return state.local if state.local_left == 0 else None

    def add_peer(self, contribution: Contribution) -> PeerOutcome:
        """Adds a peer's value; repeated or late messages change nothing.

        Raises:
          ValueError: the key holds values of the other kind (the key fails),
            or is a new key out of bounds (see the module docstring).
          AllReduceClosedError: the table is closed.
        """
        key, src = contribution.sync_key, contribution.src_rank
        with self._lock:
            if key in self._finished:
                self._counts["late_ignored"] += 1
                return PeerOutcome.LATE
            if key not in self._pending:
                self._admit_peer_key(key, src)
            state = self._state(key)
            if src in state.peers_in:
                self._counts["duplicates_ignored"] += 1
                return PeerOutcome.DUPLICATE
            if state.kind not in (None, contribution.kind):
                message = (
                    f"rank {src} sent a {contribution.kind.value} value for sync key {key}, "
                    f"which holds {state.kind.value} values on rank {self._rank}."
                )
                self._fail_locked(key, state, self._peer_error(key, src, message))
                raise ValueError(message)
            state.kind = contribution.kind
            state.peers |= contribution.value
            state.peers_in.add(src)
            self._finish_if_complete(key, state)
            return PeerOutcome.ACCEPTED

    def wait(self, sync_key: int) -> tuple[ValueKind, int]:
        """Blocks until the key is finished; at most `deadline_s` seconds.

        Returns:
          (kind, OR of all contributions).

        Raises:
          AllReduceTimeoutError: the deadline passed first; the key fails for
            every thread waiting on it.
          AllReduceError: the key failed otherwise.
        """
        start = time.monotonic()
        with self._lock:
            state = self._local_state(sync_key)
            while not state.finished:
                remaining = start + self._deadline_s - time.monotonic()
                if remaining <= 0:
                    self._fail_locked(sync_key, state, self._timeout(sync_key, state, start))
                    break
                state.done.wait(remaining)
            if state.error is not None:
                raise state.error()
            return state.kind, state.result

    def fail(self, sync_key: int, error: ErrorFactory) -> bool:
        """Fails a pending key for all its waiters; False if it was not pending."""
        with self._lock:
            state = self._pending.get(sync_key)
            if state is None:
                return False
            self._fail_locked(sync_key, state, error)
            return True

    def count_rejected(self) -> None:
        """Counts one peer message answered with INVALID_ARGUMENT."""
        with self._lock:
            self._counts["rejected"] += 1

    def count_auth_failure(self) -> None:
        """Counts one peer message dropped for failing authentication."""
        with self._lock:
            self._counts["auth_failed"] += 1

    def close(self) -> None:
        """Fails every pending key; later calls raise `AllReduceClosedError`."""
        with self._lock:
            self._closed = True
            for key, state in list(self._pending.items()):
                self._fail_locked(key, state, self._closed_error(key))

    def counts(self) -> dict[str, int]:
        """The counters (see `AllReduceStats`), without `send_failures`."""
        with self._lock:
            names = (
                "completed",
                "failed",
                "late_ignored",
                "duplicates_ignored",
                "rejected",
                "auth_failed",
                "expired",
            )
            return {name: self._counts[name] for name in names} | {"pending": len(self._pending)}

    def _state(self, sync_key: int) -> _Key:
        if self._closed:
            raise self._closed_error(sync_key)()
        state = self._pending.get(sync_key) or self._finished.get(sync_key)
        if state is None:
            state = self._pending[sync_key] = _Key(self._k, self._lock)
        return state

    def _local_state(self, sync_key: int) -> _Key:
        """The key's state, which a local thread now holds on to: it never expires."""
        state = self._state(sync_key)
        self._peer_only.pop(sync_key, None)
        return state

    def _admit_peer_key(self, sync_key: int, src_rank: int) -> None:
        """Registers a key a peer starts, or raises `ValueError` if out of bounds."""
        if self._closed:
            raise self._closed_error(sync_key)()
        now = time.monotonic()
        self._expire_peer_keys(now)
        last = self._last_local
        if last is not None and abs(sync_key - last) > self._key_window:
            raise ValueError(
                f"rank {src_rank} sent sync key {sync_key}, more than {self._key_window} keys "
                f"away from the latest key of rank {self._rank} ({last}); every host must run "
                "the same rounds."
            )
        if len(self._peer_only) >= self._pending_limit:
            raise ValueError(
                f"rank {src_rank} sent sync key {sync_key}, but rank {self._rank} already holds "
                f"{self._pending_limit} keys that only peers have started; the sender runs too "
                "far ahead."
            )
        self._peer_only[sync_key] = now

    def _expire_peer_keys(self, now: float) -> None:
        while self._peer_only:
            key, started = next(iter(self._peer_only.items()))
            if started + self._deadline_s > now:
                return
            del self._peer_only[key]
            del self._pending[key]
            self._counts["expired"] += 1

    def _finish_if_complete(self, sync_key: int, state: _Key) -> None:
        if state.local_left == 0 and len(state.peers_in) == len(self._peers) - 1:
            state.result = state.local | state.peers
            self._retire(sync_key, state, "completed")

    def _fail_locked(self, sync_key: int, state: _Key, error: ErrorFactory) -> None:
        state.error = error
        self._retire(sync_key, state, "failed")

    def _retire(self, sync_key: int, state: _Key, outcome: str) -> None:
        self._counts[outcome] += 1
        del self._pending[sync_key]
        self._peer_only.pop(sync_key, None)
        self._finished[sync_key] = state
        if len(self._finished) > self._window:
            self._finished.popitem(last=False)
        state.done.notify_all()

    def _finished_error(self, sync_key: int, state: _Key) -> Exception:
        if state.error is not None:
            return state.error()
        return ValueError(self._extra_local_message(sync_key))

    def _extra_local_message(self, sync_key: int) -> str:
        return (
            f"sync key {sync_key} already had its {self._k} local contributions on rank "
            f"{self._rank}; use a new key for every round (e.g. 2*batch and 2*batch+1)."
        )

    def _timeout(self, sync_key: int, state: _Key, start: float) -> ErrorFactory:
        elapsed = time.monotonic() - start
        missing = tuple(
            r for r in range(len(self._peers)) if r != self._rank and r not in state.peers_in
        )
        missing_local = state.local_left
        parts = []
        if missing:
            addresses = ", ".join(f"{r} ({self._peers[r]})" for r in missing)
            parts.append(f"no value from peer rank(s) {addresses}")
        if missing_local:
            parts.append(f"{missing_local} of {self._k} local contribution(s) missing")
        message = (
            f"all-reduce of sync key {sync_key} timed out on rank {self._rank} after "
            f"{elapsed:.1f} s (deadline {self._deadline_s} s): {'; '.join(parts)}. "
            "Check that every host runs the same rounds and that the peers are up."
        )
        return lambda: AllReduceTimeoutError(
            message,
            sync_key=sync_key,
            rank=self._rank,
            missing_ranks=missing,
            missing_local=missing_local,
            elapsed_s=elapsed,
        )

    def _peer_error(self, sync_key: int, peer_rank: int, message: str) -> ErrorFactory:
        return lambda: AllReducePeerError(
            message, sync_key=sync_key, rank=self._rank, peer_rank=peer_rank
        )

    def _closed_error(self, sync_key: int) -> ErrorFactory:
        message = (
            f"all-reduce node of rank {self._rank} was closed; sync key {sync_key} not reduced."
        )
        return lambda: AllReduceClosedError(message, sync_key=sync_key, rank=self._rank)
