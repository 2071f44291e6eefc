"""Binding the gRPC server of a node, separately from starting it.

Binding first lets a process learn its port (port 0 picks a free one) before
the peer list, which contains that port, is known.
"""

from __future__ import annotations

import ipaddress
import logging
from concurrent import futures

import grpc

from parallel.allreduce import _rpc
from parallel.allreduce._servicer import AllReduceServicer

_log = logging.getLogger(__name__)

# Every peer's `ContributeStream` holds one thread for as long as it is open,
# and a few more serve unary calls. The pool starts threads only when no idle
# one is left, so a generous cap costs nothing for small groups.
DEFAULT_MAX_WORKERS = 64

_SERVER_OPTIONS = [
    # Refuse a port another server already listens on, instead of sharing it
    # and splitting the peers' messages between two processes.
    ("grpc.so_reuseport", 0),
    # A message is a key, a rank, a value and a 32-byte HMAC.
    ("grpc.max_receive_message_length", 1024),
    ("grpc.max_metadata_size", 8 * 1024),
    # A peer needs one stream per connection (two while one replaces the
    # other); more on one connection is a client hoarding threads.
    ("grpc.max_concurrent_streams", 4),
    # A connection must finish its (TLS) handshake quickly.
    ("grpc.server_handshake_timeout_ms", 10_000),
    # Dead peers: pinged after 30 s without traffic, dropped 10 s later.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # Connections without any call are closed after 5 minutes.
    ("grpc.max_connection_idle_ms", 300_000),
    # Clients' pings cost the server; at most one per 10 s without data.
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 2),
]


class BoundServer:
    """A gRPC server bound to a port and not serving yet; owned by one node.

    Create with `bind_server`; pass to `AllReduceNode(port=...)`, which starts
    it and stops it on `close()`.
    """

    def __init__(
        self,
        server: grpc.Server,
        executor: futures.ThreadPoolExecutor,
        port: int,
        max_workers: int,
        *,
        secure: bool,
    ):
        self._server = server
        self._executor = executor
        self._port = port
        self._max_workers = max_workers
        self._secure = secure
        self._started = False

    @property
    def port(self) -> int:
        """The bound port."""
        return self._port

    @property
    def secure(self) -> bool:
        """Whether it was bound with TLS credentials."""
        return self._secure

    def start(self, servicer: AllReduceServicer, *, peers: int) -> None:
        """Serves `servicer` for a node with `peers` peers; a server can be started once.

        Raises:
          ValueError: the server was started already, or has fewer threads
            than one per peer's stream plus two.
        """
        if self._started:
            raise ValueError(
                f"The server on port {self._port} already serves a node; bind one per node."
            )
        if self._max_workers < peers + 2:
            raise ValueError(
                f"The server on port {self._port} has max_workers={self._max_workers}, but "
                f"each of the {peers} peers holds a thread with its stream, and one more "
                f"serves a peer that reconnects; bind it with max_workers >= {peers + 2}."
            )
        _rpc.add_servicer(servicer, self._server)
        self._server.start()
        self._started = True

    def unidentified_stream_limit(self, *, peers: int) -> int:
        """How many unidentified streams the server may hold (see `_admission.py`).

        Half of the threads the peers' own streams leave free, the rest stay
        free for unary calls.
        """
        return max((self._max_workers - peers) // 2, 1)

    def stop(self, grace_s: float) -> None:
        """Stops serving (in-flight calls get `grace_s` seconds) and joins the threads."""
        self._server.stop(grace_s).wait()
        self._executor.shutdown(wait=True)


def bind_server(
    port: int = 0,
    *,
    host: str = "[::]",
    max_workers: int = DEFAULT_MAX_WORKERS,
    credentials: grpc.ServerCredentials | None = None,
) -> BoundServer:
    """Binds a server for an `AllReduceNode` on `host:port`.

    Args:
      port: the port; 0 picks a free one (read it from `.port`).
      host: the interface to listen on; "[::]" for all, "127.0.0.1" for
        loopback only.
      max_workers: threads serving the RPCs, and the most RPCs served at
        once (more are refused with RESOURCE_EXHAUSTED); at least the node's
        peers plus two.
      credentials: TLS credentials, from `AllReduceSecurity.server_credentials`
        (the node's security must then have a `tls_dir`); None: insecure,
        with a warning unless `host` is a loopback address.

    Raises:
      OSError: the address cannot be bound (e.g. the port is in use).
    """
    executor = futures.ThreadPoolExecutor(max_workers, thread_name_prefix="allreduce-server")
    server = grpc.server(executor, options=_SERVER_OPTIONS, maximum_concurrent_rpcs=max_workers)
    address = f"{host}:{port}"
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as e:
        executor.shutdown(wait=False)
        raise OSError(
            f"Cannot listen on {address} for the all-reduce ({e}); choose a free port "
            "(every host's port must match its entry in the peer list)."
        ) from e
    if credentials is None and not is_loopback(host):
        _log.warning(
            "all-reduce server on %s:%d is insecure and reachable from other machines: any "
            "process that reaches it can speak for a rank. Set a TLS directory or a secret "
            "file (--agreement-tls-dir / --agreement-secret-file).",
            host,
            bound,
        )
    _log.debug("all-reduce server bound to %s:%d", host, bound)
    return BoundServer(server, executor, bound, max_workers, secure=credentials is not None)


def is_loopback(host: str) -> bool:
    """Whether `host` ("127.0.0.1", "[::1]", "localhost") only listens on loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
