"""One long-lived `ContributeStream` to one peer, reopened when it breaks.

Why a stream: a unary call per value cost two to three times the CPU of a
value sent on an open stream, on each side (docs/benchmarks.md). The stream
is opened on the first send, and gRPC's own
thread feeds it from a queue, so `send` only appends and returns.

Delivery: every message stays in the unacknowledged log until the peer
acknowledges it (`ContributeReply.handled`, every few messages) or it
expires. When the stream breaks (the peer restarted, the connection dropped),
the stream thread reopens it after a backoff, waiting for the peer to come up
(`wait_for_ready`), and resends the log; the peer ignores the repeats. A
message whose deadline has passed is not resent: the waiting threads report
the missing peer by then. With nothing left to resend, the stream is reopened
by the next `send` instead: the peer ends streams that stay silent while
unidentified (see `_admission.py`).

Locking: `_lock` guards the log, the current queue and call, and the flags.
It is never held while calling into gRPC, blocking on a queue, or calling
`on_rejected`.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from parallel.allreduce import _rpc, allreduce_pb2

_log = logging.getLogger(__name__)

OnRejected = Callable[[int, int, str], None]

# Ends the requests of one stream: the sender half-closes it.
_END = object()
_INITIAL_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 1.0


class PeerStream:
    """Sends messages to one peer over a stream owned by a thread of its own.

    Args:
      channel: the channel to the peer.
      peer_rank: the peer's rank (passed to `on_rejected`, named in logs).
      address: the peer's "host:port" (named in logs).
      on_rejected: called as `(sync_key, peer_rank, details)` when the peer
        rejects a message.
    """

    def __init__(
        self, *, channel: grpc.Channel, peer_rank: int, address: str, on_rejected: OnRejected
    ):
        self._open_call = _rpc.AllReduceStub(channel).ContributeStream
        self._peer_rank = peer_rank
        self._address = address
        self._on_rejected = on_rejected
        self._lock = threading.Lock()
        # (message, deadline) not acknowledged yet, in the order of the current
        # stream: its n-th message is _unacked[n - 1 - _acked].
        self._unacked: collections.deque[tuple[allreduce_pb2.AllReduceData, float]] = (
            collections.deque()
        )
        self._acked = 0
        self._queue: queue.SimpleQueue | None = None
        self._call: grpc.Call | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._cancelled = False
        self._wake = threading.Event()
        self._failures = 0

    @property
    def failures(self) -> int:
        """Messages rejected by the peer or expired before they could be resent."""
        with self._lock:
            return self._failures

    def send(self, message: allreduce_pb2.AllReduceData, deadline: float) -> None:
        """Queues `message` for the peer; opens the stream on the first call.

        Args:
          message: the value to send.
          deadline: `time.monotonic()` time after which it is not resent.
        """
        with self._lock:
            if self._closing:
                return
            self._unacked.append((message, deadline))
            if self._queue is not None:
                self._queue.put(message)
            elif self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"allreduce-stream-{self._peer_rank}", daemon=True
                )
                self._thread.start()

    def close_requests(self) -> None:
        """Half-closes the stream: the messages queued so far are still sent."""
        with self._lock:
            self._closing = True
            if self._queue is not None:
                self._queue.put(_END)
        self._wake.set()

    def join(self, deadline: float) -> None:
        """Waits until `deadline` for the peer to handle everything, then cancels."""
        thread = self._thread
        if thread is None:
            return
        thread.join(timeout=max(deadline - time.monotonic(), 0.0))
        with self._lock:
            self._cancelled = True
            call = self._call
        if call is not None:
            call.cancel()
        thread.join()

    def _run(self) -> None:
        backoff = _INITIAL_BACKOFF_S
        while True:
            requests = self._next_requests()
            if requests is None:
                return
            call = self._open_call(requests, wait_for_ready=True)
            with self._lock:
                self._call = call
                cancelled = self._cancelled
            if cancelled:
                call.cancel()
            try:
                for reply in call:
                    self._on_reply(reply)
                    backoff = _INITIAL_BACKOFF_S
                why = "the peer ended it"
            except grpc.RpcError as e:
                why = f"{e.code().name}: {e.details()}"
            with self._lock:
                if self._closing:
                    # After the half-close, OK means the peer handled every
                    # message; an error means it is gone or we cancelled.
                    return
            _log.warning(
                "all-reduce: stream to rank %d (%s) broke (%s); reopening",
                self._peer_rank,
                self._address,
                why,
            )
            self._wake.wait(backoff)
            backoff = min(2 * backoff, _MAX_BACKOFF_S)

    def _next_requests(self) -> Iterator[allreduce_pb2.AllReduceData] | None:
        """A fresh queue holding the log, as the requests of a new stream.

        A new queue per stream: the request thread of a broken stream may
        still take one more item from its own queue, and must not take it
        from the new one. None when the log is empty: this thread ends, and
        the next `send` starts another.
        """
        now = time.monotonic()
        with self._lock:
            expired = [m for m, deadline in self._unacked if deadline <= now]
            if expired:
                self._unacked = collections.deque((m, d) for m, d in self._unacked if d > now)
                self._failures += len(expired)
            self._acked = 0
            if self._queue is not None:
                self._queue.put(_END)
            if not self._unacked and not self._closing:
                self._queue = self._thread = None
                requests = None
            else:
                requests = self._queue = self._fresh_queue()
        self._warn_expired(expired)
        return None if requests is None else iter(requests.get, _END)

    def _fresh_queue(self) -> queue.SimpleQueue:
        """The log (and the half-close, if any) in a new queue; the caller holds `_lock`."""
        requests = queue.SimpleQueue()
        for message, _ in self._unacked:
            requests.put(message)
        if self._closing:
            requests.put(_END)
        return requests

    def _warn_expired(self, expired: list[allreduce_pb2.AllReduceData]) -> None:
        if expired:
            _log.warning(
                "all-reduce: %d value(s), the first for sync key %d, not delivered to rank %d "
                "(%s) before their deadline",
                len(expired),
                expired[0].sync_key,
                self._peer_rank,
                self._address,
            )

    def _on_reply(self, reply: allreduce_pb2.ContributeReply) -> None:
        with self._lock:
            while self._acked < reply.handled and self._unacked:
                self._unacked.popleft()
                self._acked += 1
            if reply.rejected:
                self._failures += 1
        if reply.rejected:
            self._on_rejected(reply.rejected_sync_key, self._peer_rank, reply.rejected)
