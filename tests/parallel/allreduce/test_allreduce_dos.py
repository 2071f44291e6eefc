"""Limits that keep a stranger's streams, calls and keys from starving a genuine round."""

import queue
import threading
import time
import tracemalloc

import allreduce_hosts
import groups
import grpc
import pytest

from parallel.allreduce import AllReduceNode, bind_server
from parallel.allreduce import allreduce_pb2 as pb
from parallel.allreduce._admission import StreamRegistry
from parallel.allreduce._rpc import AllReduceStub
from parallel.allreduce._server import is_loopback
from parallel.allreduce._servicer import AllReduceServicer

RPC_TIMEOUT_S = 20
WAIT_S = 20


def wait_until(condition, what):
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.02)


class Stranger:
    """Opens streams to a port, each on its own connection, sending only what it is told."""

    def __init__(self, port):
        self._address = f"127.0.0.1:{port}"
        self._channels, self._queues, self.calls = [], [], []

    def open(self, *messages, half_close=False):
        # A channel of its own: one connection per stream, as many clients would open.
        channel = grpc.insecure_channel(
            self._address, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        requests = queue.SimpleQueue()
        for fields in messages:
            requests.put(pb.AllReduceData(**fields))
        if half_close:
            requests.put(None)
        call = AllReduceStub(channel).ContributeStream(iter(requests.get, None))
        grpc.channel_ready_future(channel).result(timeout=WAIT_S)
        self._channels.append(channel)
        self._queues.append(requests)
        self.calls.append(call)
        return call

    def close(self):
        for requests in self._queues:
            requests.put(None)
        for call in self.calls:
            call.cancel()
        for channel in self._channels:
            channel.close()


@pytest.fixture
def stranger_of():
    strangers = []

    def make(port):
        strangers.append(Stranger(port))
        return strangers[-1]

    yield make
    for stranger in strangers:
        stranger.close()


@pytest.fixture
def lone_node():
    """Rank 0 of 3; ranks 1 and 2 are played by the test (nothing listens there)."""
    silent = allreduce_hosts.free_ports(2)
    peers = ["127.0.0.1:0", *(f"127.0.0.1:{port}" for port in silent)]
    node = AllReduceNode(0, peers, port=0, deadline_s=30)
    yield node
    node.close(grace_s=0)


def test_idle_streams_of_a_stranger_do_not_starve_a_round(make_group, stranger_of):
    nodes = make_group(2, deadline_s=10.0)
    stranger = stranger_of(nodes[0].port)
    for _ in range(64):
        stranger.open()
    assert groups.all_reduce_together(nodes, 1, [0x1, 0x2]) == [0x3, 0x3]
    assert groups.all_reduce_together(nodes, 2, [True, False]) == [True, True]
    # The server holds at most (64 - 1) // 2 = 31 unidentified streams.
    assert nodes[0].stats().streams_ended >= 64 - 31


def test_a_second_stream_of_a_rank_replaces_the_first(lone_node, stranger_of):
    stranger = stranger_of(lone_node.port)
    first = stranger.open(dict(sync_key=1, src_rank=1, bool_val=True))
    wait_until(lambda: lone_node.stats().pending == 1, "the first stream's value is in")
    stranger.open(dict(sync_key=2, src_rank=1, bool_val=True))
    with pytest.raises(grpc.RpcError) as info:
        list(first)
    assert info.value.code() is grpc.StatusCode.CANCELLED
    assert lone_node.stats().streams_ended == 1 and lone_node.stats().pending == 2


def test_a_stream_speaks_for_one_rank_only(lone_node, stranger_of):
    stranger = stranger_of(lone_node.port)
    stranger.open(
        dict(sync_key=1, src_rank=1, bool_val=True),
        dict(sync_key=1, src_rank=2, bool_val=True),
    )
    wait_until(lambda: lone_node.stats().auth_failed == 1, "the second value is dropped")
    assert lone_node.stats().pending == 1


def test_distinct_keys_from_one_stream_do_not_grow_memory(lone_node, stranger_of):
    count, limit = 20_000, 1024  # the default pending_limit
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        stranger = stranger_of(lone_node.port)
        replies = stranger.open(
            *(dict(sync_key=key, src_rank=1, uint64_val=1) for key in range(count)),
            half_close=True,
        )
        rejected = sum(1 for reply in replies if reply.rejected)  # ends after the last one
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    stats = lone_node.stats()
    assert (stats.pending, stats.rejected, rejected) == (limit, count - limit, count - limit)
    assert grown < 4 * 2**20, f"{grown / 2**20:.1f} MiB held after {count} keys"


def test_more_calls_than_threads_are_refused():
    release = threading.Event()
    entered = threading.Semaphore(0)

    def receive(message, expected_rank):
        entered.release()
        release.wait(WAIT_S)
        return message.src_rank

    server = bind_server(0, host="127.0.0.1", max_workers=3)
    server.start(AllReduceServicer(receive, streams=StreamRegistry(1)), peers=1)
    message = pb.AllReduceData(sync_key=1, src_rank=1, bool_val=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = AllReduceStub(channel)
            held = [stub.ContributeData.future(message, timeout=RPC_TIMEOUT_S) for _ in range(3)]
            for _ in held:
                assert entered.acquire(timeout=WAIT_S)
            with pytest.raises(grpc.RpcError) as info:
                stub.ContributeData(message, timeout=RPC_TIMEOUT_S)
            release.set()
            assert [future.exception() for future in held] == [None] * 3
    finally:
        release.set()
        server.stop(0)
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    "host, loopback",
    [("127.0.0.1", True), ("127.0.0.2", True), ("[::1]", True), ("localhost", True),
     ("[::]", False), ("0.0.0.0", False), ("10.0.0.2", False), ("node-1", False)],
)  # fmt: skip
def test_only_loopback_addresses_count_as_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_an_insecure_loopback_server_binds_without_a_warning(caplog):
    server = bind_server(0, host="127.0.0.1")
    server.stop(0)
    assert "insecure" not in caplog.text
