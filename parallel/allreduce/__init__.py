"""Cross-host OR all-reduce over gRPC, for agreeing on minibatching.

Each host runs an `AllReduceNode`; K local threads contribute a bool or
uint64 value per sync key, the last one sends the host's OR to every peer, and
`get_result` returns the OR over all hosts once every value is in (or raises
`AllReduceTimeoutError` naming the missing peers after the deadline). Peers
prove their rank with mutual TLS and/or an HMAC keyed by a shared secret
(`AllReduceSecurity`); without either, the group is for loopback only. The
preprocessing calls it through `AllReduceNode.interface()` or, in Grain
worker processes, through a picklable `LazyAllReduce` (one agreement group
per worker, on `agreement_port(base_port, worker_index)`).

    >>> from parallel import allreduce
    >>> with allreduce.AllReduceNode(rank=0, peers=["localhost:0"]) as node:
    ...     node.interface().all_reduce_bool(0, True)
    True
"""

from parallel.allreduce._config import AllReduceConfig, agreement_port
from parallel.allreduce._errors import (
    AllReduceClosedError,
    AllReduceError,
    AllReducePeerError,
    AllReduceTimeoutError,
)
from parallel.allreduce._lazy import LazyAllReduce, init_agreement_worker
from parallel.allreduce._node import AllReduceNode, NodeInterface
from parallel.allreduce._security import AllReduceSecurity
from parallel.allreduce._server import BoundServer, bind_server
from parallel.allreduce._types import AllReduceInterface, AllReduceStats

__all__ = [
    "AllReduceClosedError",
    "AllReduceConfig",
    "AllReduceError",
    "AllReduceInterface",
    "AllReduceNode",
    "AllReducePeerError",
    "AllReduceSecurity",
    "AllReduceStats",
    "AllReduceTimeoutError",
    "BoundServer",
    "LazyAllReduce",
    "NodeInterface",
    "agreement_port",
    "bind_server",
    "init_agreement_worker",
]
