"""The settings of one agreement group, and the per-worker port convention.

One agreement group is N hosts, each with a rank (its index in `peers`) and
an `AllReduce` server. When the preprocessing runs in Grain worker processes,
worker w of every host forms its own group: batches are assigned to workers
deterministically, so worker w of every host handles the same batches. Group
w listens on `agreement_port(base_port, w) = base_port + w`, i.e. the peer
list of group w is the base list with every port shifted by w
(`AllReduceConfig.for_worker`). Keep the ports `base_port .. base_port +
num_workers - 1` free on every host.
"""

from __future__ import annotations

import dataclasses

from parallel.allreduce._security import AllReduceSecurity

DEFAULT_DEADLINE_S = 60.0
DEFAULT_FINISHED_WINDOW = 16384
# Genuine peers run at most a few rounds ahead; these bound what a faulty or
# hostile one can make a host hold (about 1.5 KB per pending key).
DEFAULT_PENDING_LIMIT = 1024
DEFAULT_KEY_WINDOW = 65536
MAX_PORT = 65535


def split_address(address: str) -> tuple[str, int]:
    """`"host:port"` (or `"[v6]:port"`) as (host, port).

    Raises:
      ValueError: `address` has no host or no integer port in [0, 65535].
    """
    if not isinstance(address, str):
        raise TypeError(f"A peer address must be a 'host:port' string, got {address!r}.")
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(
            f"Peer address {address!r} is not 'host:port' (e.g. '10.0.0.2:8470' or '[::1]:8470')."
        )
    port = int(port_text)
    if port > MAX_PORT:
        raise ValueError(f"Peer address {address!r} has port {port} > {MAX_PORT}.")
    return host, port


def agreement_port(base_port: int, worker_index: int) -> int:
    """The port of worker `worker_index`'s agreement group: `base_port + worker_index`.

    Raises:
      ValueError: a negative argument, or a port past 65535.
    """
    if base_port < 0 or worker_index < 0:
        raise ValueError(
            f"base_port and worker_index must be >= 0, got {base_port} and {worker_index}."
        )
    port = base_port + worker_index
    if port > MAX_PORT:
        raise ValueError(
            f"Worker {worker_index} would listen on port {port} > {MAX_PORT}; "
            "choose a lower base_port."
        )
    return port


def _shift_port(address: str, worker_index: int) -> str:
    host, port = split_address(address)
    return f"{host}:{agreement_port(port, worker_index)}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllReduceConfig:
    """Everything needed to create an `AllReduceNode`; picklable.

    Pass this (not a node) to worker processes and create the node there,
    with `AllReduceNode.from_config` or through `LazyAllReduce`.

    Attributes:
      rank: this host's index in `peers`.
      peers: "host:port" of every host of the group, in rank order, this host
        included. The node listens on the port of `peers[rank]` unless `port`
        is given, and never sends to itself.
      port: the port to listen on instead of the one in `peers[rank]`; 0 picks
        a free port (read it back from `AllReduceNode.port`).
      local_contributors: K, the threads of this host that contribute to every
        key; the host's value is sent once all K are in.
      deadline_s: seconds a thread waits for a key (counted from its own
        contribution or `get_result` call) before `AllReduceTimeoutError`;
        sends are retried for as long.
      finished_window: how many of the most recently finished keys are
        remembered, so that a repeated or late message for one of them is
        recognized and ignored. It must cover every key that can finish
        within one deadline; a message for a key older than the window would
        start a new round that never completes. Each entry costs about 200
        bytes.
      pending_limit: how many keys that only peers have started (no local
        contribution yet) are held at once; a peer's message for one more is
        rejected. Such keys are forgotten `deadline_s` after they started.
      key_window: a peer's message that starts a key more than this many
        keys away from this host's latest local key is rejected.
      security: mutual TLS and/or a shared secret (`AllReduceSecurity`);
        None runs insecure, for loopback only.
    """

    rank: int
    peers: tuple[str, ...]
    port: int | None = None
    local_contributors: int = 1
    deadline_s: float = DEFAULT_DEADLINE_S
    finished_window: int = DEFAULT_FINISHED_WINDOW
    pending_limit: int = DEFAULT_PENDING_LIMIT
    key_window: int = DEFAULT_KEY_WINDOW
    security: AllReduceSecurity | None = None

    def __post_init__(self):
        if isinstance(self.peers, str) or not self.peers:
            raise ValueError(
                f"peers must be a non-empty sequence of 'host:port' strings, got {self.peers!r}."
            )
        object.__setattr__(self, "peers", tuple(self.peers))
        _check_unique(self.peers)
        if not 0 <= self.rank < len(self.peers):
            raise ValueError(
                f"rank {self.rank} is outside the {len(self.peers)} peers {list(self.peers)}."
            )
        if self.port is not None and not 0 <= self.port <= MAX_PORT:
            raise ValueError(f"port must be in [0, {MAX_PORT}], got {self.port}.")
        if self.local_contributors < 1:
            raise ValueError(f"local_contributors must be >= 1, got {self.local_contributors}.")
        if not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0 seconds, got {self.deadline_s}.")
        for name in ("finished_window", "pending_limit", "key_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.security is not None and not isinstance(self.security, AllReduceSecurity):
            raise TypeError(
                f"security must be an AllReduceSecurity or None, got {self.security!r}."
            )

    @property
    def world_size(self) -> int:
        """N, the number of hosts in the group."""
        return len(self.peers)

    @property
    def listen_port(self) -> int:
        """The port this host's server binds: `port`, else the one in `peers[rank]`."""
        return split_address(self.peers[self.rank])[1] if self.port is None else self.port

    def for_worker(self, worker_index: int) -> AllReduceConfig:
        """The group of Grain worker `worker_index`: every port shifted by it.

        With security, the group's run id names the worker, so that a message
        of one group is never accepted by another.
        """
        return dataclasses.replace(
            self,
            peers=tuple(_shift_port(peer, worker_index) for peer in self.peers),
            port=None if self.port is None else agreement_port(self.port, worker_index),
            security=None if self.security is None else self.security.for_worker(worker_index),
        )


def _check_unique(peers: tuple[str, ...]) -> None:
    seen: dict[tuple[str, int], int] = {}
    for rank, peer in enumerate(peers):
        address = split_address(peer)
        # Port 0 stands for "picked at bind time" and may repeat.
        if address[1] != 0 and address in seen:
            raise ValueError(f"Ranks {seen[address]} and {rank} have the same address {peer!r}.")
        seen[address] = rank
