"""Binding the gRPC server of a node, separately from starting it.

Binding first lets a process learn its port (port 0 picks a free one) before
the peer list, which contains that port, is known.
"""

from __future__ import annotations

import logging
from concurrent import futures

import grpc

from parallel.allreduce import allreduce_pb2_grpc
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
    ):
        self._server = server
        self._executor = executor
        self._port = port
        self._max_workers = max_workers
        self._started = False

    @property
    def port(self) -> int:
        """The bound port."""
        return self._port

    def start(self, servicer: AllReduceServicer, *, peers: int) -> None:
        """Serves `servicer` for a node with `peers` peers; a server can be started once.

        Raises:
          ValueError: the server was started already, or has fewer threads
            than one per peer's stream plus one.
        """
        if self._started:
            raise ValueError(
                f"The server on port {self._port} already serves a node; bind one per node."
            )
        if self._max_workers <= peers:
            raise ValueError(
                f"The server on port {self._port} has max_workers={self._max_workers}, but "
                f"each of the {peers} peers holds a thread with its stream; bind it with "
                f"max_workers >= {peers + 1}."
            )
        allreduce_pb2_grpc.add_AllReduceServicer_to_server(servicer, self._server)
        self._server.start()
        self._started = True

    def stop(self, grace_s: float) -> None:
        """Stops serving (in-flight calls get `grace_s` seconds) and joins the threads."""
        self._server.stop(grace_s).wait()
        self._executor.shutdown(wait=True)


def bind_server(
    port: int = 0, *, host: str = "[::]", max_workers: int = DEFAULT_MAX_WORKERS
) -> BoundServer:
    """Binds a server for an `AllReduceNode` on `host:port`.

    Args:
      port: the port; 0 picks a free one (read it from `.port`).
      host: the interface to listen on; "[::]" for all, "127.0.0.1" for
        loopback only.
      max_workers: threads serving the RPCs; more than the node's peers.

    Raises:
      OSError: the address cannot be bound (e.g. the port is in use).
    """
    executor = futures.ThreadPoolExecutor(max_workers, thread_name_prefix="allreduce-server")
    server = grpc.server(executor, options=_SERVER_OPTIONS)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as e:
        executor.shutdown(wait=False)
        raise OSError(
            f"Cannot listen on {host}:{port} for the all-reduce ({e}); choose a free port "
            "(every host's port must match its entry in the peer list)."
        ) from e
    _log.debug("all-reduce server bound to %s:%d", host, bound)
    return BoundServer(server, executor, bound, max_workers)
