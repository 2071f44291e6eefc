"""Nodes in one process: local threads, in-process groups, errors, shutdown, pickling."""

import functools
import pickle
import threading

import allreduce_hosts
import numpy as np
import pytest

from parallel.allreduce import (
    AllReduceClosedError,
    AllReduceConfig,
    AllReduceNode,
    AllReducePeerError,
    AllReduceTimeoutError,
    LazyAllReduce,
    bind_server,
    init_agreement_worker,
)

JOIN_TIMEOUT_S = 60


def run_threads(targets):
    """Runs the callables in threads; returns their results or exceptions, in order."""
    out = [None] * len(targets)

    def run(i):
        try:
            out[i] = targets[i]()
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(targets))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=JOIN_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    return out


def expected_or(values):
    """OR per key of values[contributor][key] (bool keys even, uint64 keys odd)."""
    array = np.array(values, dtype=object)
    return [functools.reduce(lambda a, b: a | b, array[:, key]) for key in range(array.shape[1])]


def in_process_group(world, k, deadline_s=30.0):
    servers = [bind_server(0, host="127.0.0.1") for _ in range(world)]
    peers = [f"127.0.0.1:{server.port}" for server in servers]
    return [
        AllReduceNode(rank, peers, servers[rank], local_contributors=k, deadline_s=deadline_s)
        for rank in range(world)
    ]


@pytest.mark.parametrize("k", [1, 4])
def test_single_host_needs_no_server(k):
    values = [allreduce_hosts.contributions(1, 0, t, 40) for t in range(k)]
    with AllReduceNode(0, ["localhost:0"], local_contributors=k, deadline_s=30) as node:
        assert node.port is None
        results = run_threads(
            [
                functools.partial(lambda v: [node.all_reduce(key, x) for key, x in enumerate(v)], v)
                for v in values
            ]
        )
    assert results == [expected_or(values)] * k


def test_in_process_group_through_the_interface():
    world, k, keys = 3, 2, 30
    nodes = in_process_group(world, k)
    values = {
        (r, t): allreduce_hosts.contributions(2, r, t, keys) for r in range(world) for t in range(k)
    }

    def rounds(rank, thread):
        interface = nodes[rank].interface()
        out = []
        for key, value in enumerate(values[rank, thread]):
            reduce = interface.all_reduce_bool if key % 2 == 0 else interface.all_reduce_uint64
            out.append(reduce(key, value))
        return out

    try:
        results = run_threads([functools.partial(rounds, r, t) for r, t in values])
    finally:
        for node in nodes:
            node.close()
    assert results == [expected_or(list(values.values()))] * (world * k)
    assert all(type(x) is bool for x in results[0][::2])
    assert [node.stats().completed for node in nodes] == [keys] * world


@pytest.mark.parametrize(
    "method, value, match",
    [("all_reduce_bool", 1, "needs a bool"), ("all_reduce_uint64", True, "needs an integer")],
)
def test_interface_checks_the_kind(method, value, match):
    with AllReduceNode(0, ["localhost:0"]) as node:
        with pytest.raises(TypeError, match=match):
            getattr(node.interface(), method)(0, value)


def test_a_rejected_send_surfaces_on_the_sender():
    # Both nodes believe they are rank 0: each rejects the other's messages.
    a, b = bind_server(0, host="127.0.0.1"), bind_server(0, host="127.0.0.1")
    address_a, address_b = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
    with AllReduceNode(0, [address_a, address_b], a, deadline_s=60) as node_a:
        with AllReduceNode(0, [address_b, address_a], b, deadline_s=60) as node_b:
            node_b.contribute(1, True)
            with pytest.raises(AllReducePeerError) as info:
                node_b.get_result(1)
    assert info.value.peer_rank == 1 and info.value.sync_key == 1
    assert f"peer rank 1 ({address_a}) rejected the value of rank 0" in str(info.value)
    assert "src_rank 0 of sync key 1 is not a peer of rank 0" in str(info.value)
    assert node_a.stats().rejected == 1 and node_b.stats().send_failures == 1


def test_a_silent_peer_times_out_naming_its_rank():
    silent = allreduce_hosts.free_ports(1)[0]
    peers = ["127.0.0.1:0", f"127.0.0.1:{silent}"]
    with AllReduceNode(0, peers, port=0, local_contributors=2, deadline_s=1.0) as node:
        errors = run_threads([functools.partial(node.all_reduce, 3, 1)] * 2)
        node.close(grace_s=0)
    for error in errors:
        assert isinstance(error, AllReduceTimeoutError)
        assert error.missing_ranks == (1,) and error.sync_key == 3
        assert f"peer rank(s) 1 (127.0.0.1:{silent})" in str(error)


def test_close_fails_waiting_threads():
    silent = allreduce_hosts.free_ports(1)[0]
    node = AllReduceNode(0, ["127.0.0.1:0", f"127.0.0.1:{silent}"], port=0, deadline_s=60)
    node.contribute(1, False)
    started, errors = threading.Event(), []

    def wait():
        started.set()
        try:
            node.get_result(1)
        except AllReduceClosedError as e:
            errors.append(e)

    thread = threading.Thread(target=wait)
    thread.start()
    assert started.wait(timeout=JOIN_TIMEOUT_S)
    node.close(grace_s=0)
    node.close()  # idempotent
    thread.join(timeout=JOIN_TIMEOUT_S)
    assert not thread.is_alive() and len(errors) == 1
    with pytest.raises(AllReduceClosedError, match="was closed"):
        node.all_reduce(2, True)


def test_the_port_must_be_free():
    server = bind_server(0, host="127.0.0.1")
    try:
        with pytest.raises(OSError, match=f"Cannot listen on 127.0.0.1:{server.port}"):
            bind_server(server.port, host="127.0.0.1")
    finally:
        server.stop(0)


def test_the_server_needs_a_thread_per_peer_stream():
    server = bind_server(0, host="127.0.0.1", max_workers=3)
    peers = [f"127.0.0.1:{server.port}", *(f"127.0.0.1:{p}" for p in allreduce_hosts.free_ports(3))]
    with pytest.raises(ValueError, match="max_workers=3, but each of the 3 peers"):
        AllReduceNode(0, peers, server)


def test_a_node_is_not_picklable_but_its_config_is():
    with AllReduceNode(0, ["localhost:0"], local_contributors=2) as node:
        with pytest.raises(TypeError, match="AllReduceConfig"):
            pickle.dumps(node)
        clone = AllReduceNode.from_config(pickle.loads(pickle.dumps(node.config)))
        with clone:
            assert clone.config == node.config


def test_lazy_all_reduce_pickles_and_creates_its_node_on_use():
    lazy = LazyAllReduce(AllReduceConfig(rank=0, peers=("localhost:0",)))
    copy = pickle.loads(pickle.dumps(lazy))
    try:
        assert copy.all_reduce_uint64(0, 6) == 6
        assert copy.all_reduce_bool(1, True) is True
        assert copy.node() is lazy.node()  # one node per process and group
    finally:
        copy.close()


def test_worker_groups_listen_on_shifted_ports():
    base = allreduce_hosts.free_ports(2)
    peers = tuple(f"127.0.0.1:{port - 1}" for port in base)  # worker 1 gets the free ports
    lazies = [LazyAllReduce(AllReduceConfig(rank=r, peers=peers, deadline_s=30)) for r in range(2)]
    init_agreement_worker(1, 2)
    try:
        results = run_threads(
            [functools.partial(lazy.all_reduce_uint64, 7, 1 << r) for r, lazy in enumerate(lazies)]
        )
        ports = [lazy.node().port for lazy in lazies]
    finally:
        for lazy in lazies:
            lazy.close()
        init_agreement_worker(0, 1)
    assert results == [0b11, 0b11]
    assert ports == base


def test_init_agreement_worker_rejects_a_bad_index():
    with pytest.raises(ValueError, match=r"worker_index 2 is not in \[0, 2\)"):
        init_agreement_worker(2, 2)
