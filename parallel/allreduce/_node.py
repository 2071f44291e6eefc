"""One host's endpoint of the cross-host OR all-reduce (docs/design.md section 4).

Flow of one key on host i of N, with K local contributors:
  1. each local thread calls `contribute` (or `all_reduce`); the values are
     ORed into the host's value L_i;
  2. the K-th contribution queues L_i on the stream to every peer (one
     long-lived `ContributeStream` per peer, see `_stream.py`) and returns;
  3. the server checks each peer's L_j (the rank of its certificate or
     stream, its HMAC; see `AllReduceSecurity`) and ORs it into the key;
  4. `get_result` returns once K local and N-1 peer values are in.

Locks: `_close_lock` (only in `close`, released before anything else is
taken), the table's lock, each peer stream's lock, the stream registry's and
the auth warning's; no two are ever held at once, so there is no order to
violate. No lock is held while a gRPC call is started,
and a waiter blocks on its key's condition, which releases the table's lock.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence

from parallel.allreduce import allreduce_pb2
from parallel.allreduce._admission import StreamRegistry
from parallel.allreduce._codec import Contribution, decode
from parallel.allreduce._config import (
    DEFAULT_DEADLINE_S,
    DEFAULT_FINISHED_WINDOW,
    DEFAULT_KEY_WINDOW,
    DEFAULT_PENDING_LIMIT,
    AllReduceConfig,
    split_address,
)
from parallel.allreduce._errors import AllReducePeerError, UnauthenticatedError
from parallel.allreduce._security import AllReduceSecurity, PeerCredentials
from parallel.allreduce._sender import PeerSender
from parallel.allreduce._server import BoundServer, bind_server
from parallel.allreduce._servicer import AllReduceServicer
from parallel.allreduce._table import ReductionTable
from parallel.allreduce._throttle import ThrottledWarning
from parallel.allreduce._types import AllReduceStats
from parallel.allreduce._values import (
    ValueKind,
    as_bool,
    as_uint64,
    check_sync_key,
    infer,
    to_python,
)

_log = logging.getLogger(__name__)

# Peers' calls in flight to this node's server get this long when it stops.
_SERVER_GRACE_S = 0.5
DEFAULT_CLOSE_GRACE_S = 5.0
_AUTH_WARNING_INTERVAL_S = 10.0
_INSECURE = PeerCredentials(tls=None, authenticator=None)


class AllReduceNode:
    """OR all-reduce of bool or uint64 values over the hosts of a group.

    A single host (one peer) starts no server and sends nothing.

    Args:
      rank: this host's index in `peers`.
      peers: "host:port" of every host in rank order, this host included.
      port: where to listen: None for the port of `peers[rank]`, an int
        (0 picks a free one; see `.port`), or a `BoundServer` from
        `bind_server`. An int port is bound on the host of `peers[rank]`.
      local_contributors: K, the threads that contribute to every key.
      deadline_s: seconds a thread waits for a key before
        `AllReduceTimeoutError`; sends are retried for as long.
      finished_window: finished keys remembered to ignore late messages (see
        `AllReduceConfig`).
      pending_limit, key_window: bounds on the keys peers may start (see
        `AllReduceConfig`).
      security: mutual TLS and/or a shared secret; None: insecure (loopback).
        A `BoundServer` passed as `port` must have been bound with TLS
        credentials exactly when `security.tls_dir` is set.

    Example:
      >>> with AllReduceNode(rank=0, peers=["localhost:0"]) as node:
      ...     node.all_reduce(7, 0b0101)
      5
    """

    def __init__(
        self,
        rank: int,
        peers: Sequence[str],
        port: int | BoundServer | None = None,
        *,
        local_contributors: int = 1,
        deadline_s: float = DEFAULT_DEADLINE_S,
        finished_window: int = DEFAULT_FINISHED_WINDOW,
        pending_limit: int = DEFAULT_PENDING_LIMIT,
        key_window: int = DEFAULT_KEY_WINDOW,
        security: AllReduceSecurity | None = None,
    ):
        bound = port if isinstance(port, BoundServer) else None
        try:
            self._config = AllReduceConfig(
                rank=rank,
                peers=tuple(peers),
                port=bound.port if bound else port,
                local_contributors=local_contributors,
                deadline_s=deadline_s,
                finished_window=finished_window,
                pending_limit=pending_limit,
                key_window=key_window,
                security=security,
            )
            credentials = _load_credentials(self._config, bound)
        except (TypeError, ValueError):
            if bound is not None:
                bound.stop(0)  # the node owns a server passed to it, even on failure
            raise
        self._credentials = credentials
        self._table = ReductionTable(
            rank=rank,
            peers=self._config.peers,
            local_contributors=local_contributors,
            deadline_s=deadline_s,
            finished_window=finished_window,
            pending_limit=pending_limit,
            key_window=key_window,
        )
        self._auth_warning = ThrottledWarning(_log, _AUTH_WARNING_INTERVAL_S)
        self._close_lock = threading.Lock()
        self._closed = False
        self._server: BoundServer | None = None
        self._streams: StreamRegistry | None = None
        self._sender: PeerSender | None = None
        if self._config.world_size > 1:
            self._connect(bound)
        elif bound is not None:
            bound.stop(0)
        _log.info(
            "all-reduce node rank %d of %d up (port %s, K=%d, deadline %.1f s, TLS %s, HMAC %s)",
            rank,
            self._config.world_size,
            self.port,
            local_contributors,
            deadline_s,
            "on" if credentials.tls else "off",
            "on" if credentials.authenticator else "off",
        )

    def _connect(self, bound: BoundServer | None) -> None:
        """Binds (unless bound), opens the channels to the peers, starts serving."""
        config, tls = self._config, self._credentials.tls
        host = split_address(config.peers[config.rank])[0]
        credentials = None if tls is None else tls.server_credentials()
        server = bound or bind_server(config.listen_port, host=host, credentials=credentials)
        peers = config.world_size - 1
        self._streams = StreamRegistry(server.unidentified_stream_limit(peers=peers))
        servicer = AllReduceServicer(self._receive, streams=self._streams, tls=tls is not None)
        try:
            server.start(servicer, peers=peers)
        except ValueError:
            server.stop(0)  # the node owns its server, even on failure
            raise
        self._server = server
        self._sender = PeerSender(
            rank=config.rank,
            peers=config.peers,
            on_rejected=self._rejected,
            credentials=self._credentials,
        )

    @classmethod
    def from_config(
        cls, config: AllReduceConfig, server: BoundServer | None = None
    ) -> AllReduceNode:
        """The node of `config`, listening on `server` if given."""
        fields = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
        fields["port"] = server if server is not None else config.port
        return cls(**fields)

    @property
    def config(self) -> AllReduceConfig:
        """The picklable settings of this node (to create it elsewhere)."""
        return self._config

    @property
    def rank(self) -> int:
        return self._config.rank

    @property
    def world_size(self) -> int:
        return self._config.world_size

    @property
    def port(self) -> int | None:
        """The port the server listens on; None for a single host."""
        return None if self._server is None else self._server.port

    def contribute(self, sync_key: int, value: bool | int) -> None:
        """Adds one local contribution without waiting for the result.

        Args:
          sync_key: the round, in [0, 2**64).
          value: a bool (logical OR) or an int in [0, 2**64) (bitwise OR);
            one kind per key on every host.

        Raises:
          TypeError, ValueError: a bad key or value, the other kind than the
            key holds, or more than K contributions to the key.
          AllReduceError: the key already failed, or the node is closed.
        """
        self._contribute(check_sync_key(sync_key), *infer(value))

    def get_result(self, sync_key: int) -> bool | int:
        """The OR over all hosts' contributions to `sync_key`; blocks until known.

        Raises:
          AllReduceTimeoutError: not all contributions arrived within
            `deadline_s`; the message names the missing peer ranks.
          AllReducePeerError: a peer rejected this host's value or sent one of
            the other kind.
          AllReduceClosedError: the node was closed.
        """
        kind, value = self._table.wait(check_sync_key(sync_key))
        return to_python(kind, value)

    def all_reduce(self, sync_key: int, value: bool | int) -> bool | int:
        """`contribute(sync_key, value)`, then `get_result(sync_key)`."""
        self.contribute(sync_key, value)
        return self.get_result(sync_key)

    def interface(self) -> NodeInterface:
        """This node as the preprocessing's `AllReduceInterface`."""
        return NodeInterface(node=self)

    def stats(self) -> AllReduceStats:
        """The node's counters."""
        failures = 0 if self._sender is None else self._sender.failures
        ended = 0 if self._streams is None else self._streams.ended
        return AllReduceStats(**self._table.counts(), streams_ended=ended, send_failures=failures)

    def close(self, grace_s: float = DEFAULT_CLOSE_GRACE_S) -> None:
        """Fails every waiting thread, finishes the sends, stops the server.

        Threads still waiting get `AllReduceClosedError`. Sends in flight get
        up to `grace_s` seconds to reach their peers (a peer that is behind
        still needs this host's last values), then are cancelled. Idempotent.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._table.close()
        if self._sender is not None:
            self._sender.close(grace_s)
        if self._server is not None:
            self._server.stop(_SERVER_GRACE_S)
        _log.info("all-reduce node rank %d closed: %s", self.rank, self.stats())

    def __enter__(self) -> AllReduceNode:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __reduce__(self):
        raise TypeError(
            "An AllReduceNode owns a server and channels and cannot be pickled. Pass its "
            "AllReduceConfig (node.config) or a LazyAllReduce to the other process and "
            "create the node there."
        )

    def _contribute(self, sync_key: int, kind: ValueKind, value: int) -> None:
        deadline = time.monotonic() + self._config.deadline_s
        local = self._table.add_local(sync_key, kind, value)
        if local is not None and self._sender is not None:
            contribution = Contribution(
                sync_key=sync_key, src_rank=self.rank, kind=kind, value=local
            )
            self._sender.send(contribution, deadline)

    def _receive(self, message: allreduce_pb2.AllReduceData, expected_rank: int | None) -> int:
        """Records a peer's message once it is authenticated; returns its rank.

        Raises:
          ValueError: the message is malformed or its key out of bounds.
          UnauthenticatedError: it claims another rank than `expected_rank`,
            or its HMAC does not match; it is counted and logged, not recorded.
        """
        try:
            contribution = decode(message, rank=self.rank, world_size=self.world_size)
        except ValueError:
            self._table.count_rejected()
            raise
        self._authenticate(contribution, message.mac, expected_rank)
        try:
            self._table.add_peer(contribution)
        except ValueError:
            self._table.count_rejected()
            raise
        return contribution.src_rank

    def _authenticate(
        self, contribution: Contribution, mac: bytes, expected_rank: int | None
    ) -> None:
        src, key = contribution.src_rank, contribution.sync_key
        if expected_rank is not None and src != expected_rank:
            why = f"it came from rank {expected_rank}'s certificate or stream"
        elif self._credentials.authenticator and not self._credentials.authenticator.verify(
            contribution, mac
        ):
            why = "its HMAC does not match (is the secret file and run id the same on every host?)"
        else:
            return
        message = (
            f"all-reduce: rank {self.rank} dropped a value for sync key {key} claiming to be "
            f"from rank {src}: {why}"
        )
        self._table.count_auth_failure()
        self._auth_warning.warning(message)
        raise UnauthenticatedError(message)

    def _rejected(self, sync_key: int, peer_rank: int, details: str) -> None:
        address = self._config.peers[peer_rank]
        message = (
            f"peer rank {peer_rank} ({address}) rejected the value of rank {self.rank} "
            f"for sync key {sync_key}: {details}"
        )

        def error() -> AllReducePeerError:
            return AllReducePeerError(
                message, sync_key=sync_key, rank=self.rank, peer_rank=peer_rank
            )

        if not self._table.fail(sync_key, error):
            _log.error("all-reduce: %s (the key had already finished here)", message)


def _load_credentials(config: AllReduceConfig, bound: BoundServer | None) -> PeerCredentials:
    """The node's TLS files and authenticator; a single host needs none.

    Raises:
      ValueError: a file is missing or bad, or `bound` was bound with TLS
        credentials when the security has no `tls_dir`, or the reverse.
    """
    if config.security is None or config.world_size == 1:
        return _INSECURE
    credentials = config.security.load(config.rank)
    if bound is not None and bound.secure != (credentials.tls is not None):
        raise ValueError(
            f"The server passed for rank {config.rank} was bound "
            f"{'with' if bound.secure else 'without'} TLS credentials, but the security is "
            f"{config.security}; bind it with credentials=security.server_credentials(rank) "
            "exactly when tls_dir is set."
        )
    return credentials


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeInterface:
    """An `AllReduceInterface` over a node, with the value kind checked per method."""

    node: AllReduceNode

    def all_reduce_bool(self, sync_key: int, value: bool) -> bool:
        """Logical OR of `value` over all contributors; see `AllReduceNode.all_reduce`."""
        key = check_sync_key(sync_key)
        self.node._contribute(key, ValueKind.BOOL, as_bool(value))
        return self.node.get_result(key)

    def all_reduce_uint64(self, sync_key: int, value: int) -> int:
        """Bitwise OR of `value` over all contributors; see `AllReduceNode.all_reduce`."""
        key = check_sync_key(sync_key)
        self.node._contribute(key, ValueKind.UINT64, as_uint64(value))
        return self.node.get_result(key)
