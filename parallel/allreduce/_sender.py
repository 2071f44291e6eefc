"""Asynchronous sends of a host's value to its peers.

`send` encodes the value once and queues it on one `PeerStream` per peer
(see `_stream.py` for why streams, and for delivery and retries); it never
waits for the network. A peer that starts late still receives the values: a
stream waits for its peer to come up (`wait_for_ready`).

Locking: none of its own; each `PeerStream` guards its own state.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc

from parallel.allreduce._codec import Contribution, encode
from parallel.allreduce._security import PeerCredentials
from parallel.allreduce._stream import OnRejected, PeerStream
from parallel.allreduce._tls import channel_options

_CHANNEL_OPTIONS = [
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
        rejects a value.
      credentials: this rank's TLS files (the channels then check each
        peer's certificate) and the authenticator that signs every value.
    """

    def __init__(
        self,
        *,
        rank: int,
        peers: Sequence[str],
        on_rejected: OnRejected,
        credentials: PeerCredentials,
    ):
        self._authenticator = credentials.authenticator
        self._channels = {
            r: _channel(address, r, credentials) for r, address in enumerate(peers) if r != rank
        }
        self._streams = [
            PeerStream(channel=channel, peer_rank=r, address=peers[r], on_rejected=on_rejected)
            for r, channel in self._channels.items()
        ]

    @property
    def failures(self) -> int:
        """Values that finally failed (the peer rejected, or the deadline passed)."""
        return sum(stream.failures for stream in self._streams)

    def send(self, contribution: Contribution, deadline: float) -> None:
        """Queues `contribution` for every peer; does not wait.

        Args:
          contribution: the host's locally reduced value.
          deadline: `time.monotonic()` time after which a value is not resent.
        """
        mac = b"" if self._authenticator is None else self._authenticator.sign(contribution)
        message = encode(contribution, mac)
        for stream in self._streams:
            stream.send(message, deadline)

    def close(self, grace_s: float) -> None:
        """Lets the peers handle the values sent so far for up to `grace_s`, then closes.

        The wait lets peers that are behind still receive this host's last
        values after it has its own results.
        """
        deadline = time.monotonic() + grace_s
        for stream in self._streams:
            stream.close_requests()
        for stream in self._streams:
            stream.join(deadline)
        for channel in self._channels.values():
            channel.close()


def _channel(address: str, peer_rank: int, credentials: PeerCredentials) -> grpc.Channel:
    if credentials.tls is None:
        return grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
    return grpc.secure_channel(
        address,
        credentials.tls.channel_credentials(),
        options=_CHANNEL_OPTIONS + channel_options(peer_rank),
    )
