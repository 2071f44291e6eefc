"""Asynchronous sends of a host's value to its peers.

`send` only starts one gRPC call per peer and returns; the calls complete on
gRPC's threads. Each call waits for its peer to come up (`wait_for_ready`), so
a peer that starts late still receives the value, and it is retried with
backoff when the connection drops (`UNAVAILABLE`), until the contribution's
deadline.

Locking: `_lock` guards the set of calls in flight and the counters only; it
is never held while calling into gRPC or into the `on_rejected` callback.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from parallel.allreduce import allreduce_pb2_grpc
from parallel.allreduce._codec import Contribution, encode

_log = logging.getLogger(__name__)

OnRejected = Callable[[int, int, str], None]

_SERVICE_CONFIG = {
    "methodConfig": [
        {
            "name": [{"service": "sparseflow.allreduce.AllReduce"}],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.05s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ]
}

_CHANNEL_OPTIONS = [
    ("grpc.enable_retries", 1),
    ("grpc.service_config", json.dumps(_SERVICE_CONFIG)),
    # A peer that is not up yet is probed every 0.1-1 s instead of gRPC's
    # default 1-120 s, so a late start costs at most about a second.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class PeerSender:
    """Sends contributions to every peer of `rank`.

    Args:
      rank: the sending host.
      peers: "host:port" of every host in rank order.
      on_rejected: called as `(sync_key, peer_rank, details)` when a peer
        answers INVALID_ARGUMENT.
    """

    def __init__(self, *, rank: int, peers: Sequence[str], on_rejected: OnRejected):
        self._channels = {
            r: grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
            for r, address in enumerate(peers)
            if r != rank
        }
        self._stubs = {
            r: allreduce_pb2_grpc.AllReduceStub(channel) for r, channel in self._channels.items()
        }
        self._peers = tuple(peers)
        self._on_rejected = on_rejected
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight: set[grpc.Future] = set()
        self._failures = 0
        self._closed = False

    @property
    def failures(self) -> int:
        """Sends that finally failed (the peer rejected, or the deadline passed)."""
        with self._lock:
            return self._failures

    def send(self, contribution: Contribution, deadline: float) -> None:
        """Starts sending `contribution` to every peer; does not wait.

        Args:
          contribution: the host's locally reduced value.
          deadline: `time.monotonic()` time after which a send is given up.
        """
        message = encode(contribution)
        timeout = max(deadline - time.monotonic(), 0.0)
        for peer_rank, stub in self._stubs.items():
            call = stub.ContributeData.future(message, timeout=timeout, wait_for_ready=True)
            with self._lock:
                if self._closed:
                    call.cancel()
                    return
                self._in_flight.add(call)
            call.add_done_callback(functools.partial(self._done, contribution, peer_rank))

    def close(self, grace_s: float) -> None:
        """Waits up to `grace_s` for the calls in flight, cancels the rest, closes.

        The wait lets peers that are behind still receive this host's last
        values after it has its own results.
        """
        with self._lock:
            self._closed = True
            self._idle.wait_for(lambda: not self._in_flight, timeout=grace_s)
            calls = list(self._in_flight)
        for call in calls:
            call.cancel()
        for channel in self._channels.values():
            channel.close()

    def _done(self, contribution: Contribution, peer_rank: int, call: grpc.Future) -> None:
        with self._lock:
            self._in_flight.discard(call)
            if not self._in_flight:
                self._idle.notify_all()
            # CANCELLED: `close()` cancelled the call or closed its channel.
            if call.code() in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
                return
            self._failures += 1
        code, details = call.code(), call.details()
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            self._on_rejected(contribution.sync_key, peer_rank, details)
            return
        # The peer's own waiters report it missing by rank, and ours report the
        # peer if its value is missing too; here it is only logged.
        _log.warning(
            "all-reduce: sync key %d from rank %d not delivered to rank %d (%s): %s %s",
            contribution.sync_key,
            contribution.src_rank,
            peer_rank,
            self._peers[peer_rank],
            code.name,
            details,
        )
