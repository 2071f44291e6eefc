"""An all-reduce interface that creates its node in the process that uses it.

Grain pickles a pipeline's transforms into its worker processes; a live node
(server, channels, threads) cannot travel that way. `LazyAllReduce` pickles
only its `AllReduceConfig` and creates the node on first use, once per
process and config. In worker w (announced by `init_agreement_worker`, which
fits Grain's `worker_init_fn(worker_index, worker_count)`), the node joins
group w, on the ports of `config.for_worker(w)`; without workers it uses the
config's own ports.
"""

from __future__ import annotations

import atexit
import os
import threading

from parallel.allreduce._config import AllReduceConfig
from parallel.allreduce._node import AllReduceNode

_lock = threading.Lock()
_worker_index = 0
# Per process: one node per group config; reset in a forked child, whose
# copies of the parent's nodes are unusable.
_nodes: dict[AllReduceConfig, AllReduceNode] = {}
_nodes_pid = os.getpid()


def init_agreement_worker(worker_index: int, worker_count: int) -> None:
    """Declares this process as worker `worker_index` of `worker_count`.

    Call it in each worker before the first all-reduce, e.g. as Grain's
    `worker_init_fn`. Nodes created afterwards by `LazyAllReduce` join
    agreement group `worker_index`.

    Raises:
      ValueError: `worker_index` is not in [0, worker_count).
    """
    global _worker_index
    if not 0 <= worker_index < worker_count:
        raise ValueError(f"worker_index {worker_index} is not in [0, {worker_count}).")
    with _lock:
        _worker_index = worker_index


def _node_for(config: AllReduceConfig) -> AllReduceNode:
    global _nodes_pid
    with _lock:
        if _nodes_pid != os.getpid():
            _nodes.clear()
            _nodes_pid = os.getpid()
        group = config.for_worker(_worker_index)
        node = _nodes.get(group)
        if node is None:
            node = _nodes[group] = AllReduceNode.from_config(group)
        return node


def _close_node(config: AllReduceConfig) -> None:
    with _lock:
        same_process = _nodes_pid == os.getpid()
        node = _nodes.pop(config.for_worker(_worker_index), None) if same_process else None
    if node is not None:
        node.close()


@atexit.register
def _close_nodes() -> None:
    with _lock:
        nodes = list(_nodes.values()) if _nodes_pid == os.getpid() else []
        _nodes.clear()
    for node in nodes:
        node.close()


class LazyAllReduce:
    """A picklable `AllReduceInterface`; the node is created on first use.

    Args:
      config: the group of this host, with the base ports (worker 0).
    """

    def __init__(self, config: AllReduceConfig):
        self._config = config

    @property
    def config(self) -> AllReduceConfig:
        return self._config

    def node(self) -> AllReduceNode:
        """This process's node for the config (created now if needed)."""
        return _node_for(self._config)

    def all_reduce_bool(self, sync_key: int, value: bool) -> bool:
        """See `AllReduceNode.interface`."""
        return self.node().interface().all_reduce_bool(sync_key, value)

    def all_reduce_uint64(self, sync_key: int, value: int) -> int:
        """See `AllReduceNode.interface`."""
        return self.node().interface().all_reduce_uint64(sync_key, value)

    def close(self) -> None:
        """Closes this process's node for the config, if one was created."""
        _close_node(self._config)
