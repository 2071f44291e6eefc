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

# Handlers only OR a value into a table under a lock and never block, so a few
# threads serve any number of peers.
DEFAULT_MAX_WORKERS = 4

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

    def __init__(self, server: grpc.Server, executor: futures.ThreadPoolExecutor, port: int):
        self._server = server
        self._executor = executor
        self._port = port
        self._started = False

    @property
    def port(self) -> int:
        """The bound port."""
        return self._port

    def start(self, servicer: AllReduceServicer) -> None:
        """Serves `servicer`; a server can be started once."""
        if self._started:
            raise ValueError(
                f"The server on port {self._port} already serves a node; bind one per node."
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
      max_workers: threads serving the RPCs.

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
    return BoundServer(server, executor, bound)
