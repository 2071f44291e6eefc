"""The `AllReduce` service (unary and streaming) on a real server, the test acting as the peers."""

import allreduce_hosts
import grpc
import pytest
import recording

from parallel.allreduce import (
    AllReduceClosedError,
    AllReduceNode,
    AllReducePeerError,
)
from parallel.allreduce import allreduce_pb2 as pb
from parallel.allreduce._rpc import AllReduceStub
from parallel.allreduce._servicer import ACK_EVERY

RPC_TIMEOUT_S = 20


@pytest.fixture
def node():
    """Rank 0 of 3; ranks 1 and 2 are played by the test (nothing listens there)."""
    silent = allreduce_hosts.free_ports(2)
    peers = ["127.0.0.1:0", *(f"127.0.0.1:{port}" for port in silent)]
    node = AllReduceNode(0, peers, port=0, local_contributors=1, deadline_s=30)
    yield node
    node.close(grace_s=0)


@pytest.fixture
def stub(node):
    with grpc.insecure_channel(f"127.0.0.1:{node.port}") as channel:
        yield AllReduceStub(channel)


def send(stub, **fields):
    return stub.ContributeData(pb.AllReduceData(**fields), timeout=RPC_TIMEOUT_S)


@pytest.mark.parametrize("src_rank", [0, 3, 2**32 - 1])
def test_wrong_rank_is_invalid_argument(node, stub, src_rank):
    with pytest.raises(grpc.RpcError) as info:
        send(stub, sync_key=1, src_rank=src_rank, bool_val=True)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"src_rank {src_rank} of sync key 1 is not a peer of rank 0" in info.value.details()
    assert node.stats().rejected == 1 and node.stats().pending == 0


def test_missing_value_is_invalid_argument(node, stub):
    with pytest.raises(grpc.RpcError) as info:
        send(stub, sync_key=4, src_rank=1)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "has no value" in info.value.details()


def test_other_kind_is_invalid_argument_and_fails_the_key(node, stub):
    node.contribute(5, True)
    with pytest.raises(grpc.RpcError) as info:
        send(stub, sync_key=5, src_rank=2, uint64_val=3)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(AllReducePeerError, match="rank 2 sent a uint64 value for sync key 5"):
        node.get_result(5)


def test_peers_complete_a_key_and_repeats_are_ignored(node, stub):
    node.contribute(6, 0b0001)
    send(stub, sync_key=6, src_rank=1, uint64_val=0b0010)
    send(stub, sync_key=6, src_rank=1, uint64_val=0b1000_0000)  # duplicate: ignored
    send(stub, sync_key=6, src_rank=2, uint64_val=0b0100)
    send(stub, sync_key=6, src_rank=2, uint64_val=0b1000_0000)  # late: ignored
    assert node.get_result(6) == 0b0111
    stats = node.stats()
    assert (stats.completed, stats.duplicates_ignored, stats.late_ignored) == (1, 1, 1)


def test_peer_values_may_arrive_before_the_local_ones(node, stub):
    send(stub, sync_key=2**64 - 1, src_rank=1, bool_val=False)
    send(stub, sync_key=2**64 - 1, src_rank=2, bool_val=True)
    assert node.all_reduce(2**64 - 1, False) is True


@pytest.mark.parametrize(
    "error, code",
    [
        (ValueError("bad rank"), grpc.StatusCode.INVALID_ARGUMENT),
        (AllReduceClosedError("closed", sync_key=1, rank=0), grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_servicer_maps_errors_to_status_codes(error, code):
    received = []

    def receive(message):
        received.append(message)
        raise error

    server = recording.serve(receive)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            with pytest.raises(grpc.RpcError) as info:
                send(AllReduceStub(channel), sync_key=1, src_rank=1, bool_val=True)
    finally:
        server.stop(0)
    assert info.value.code() is code and info.value.details() == str(error)
    assert [(m.sync_key, m.src_rank, m.bool_val) for m in received] == [(1, 1, True)]


def stream(stub, messages):
    """The replies of one `ContributeStream` carrying `messages`, then half-closed."""
    requests = [pb.AllReduceData(**fields) for fields in messages]
    return list(stub.ContributeStream(iter(requests), timeout=RPC_TIMEOUT_S))


def test_stream_rejects_one_message_and_goes_on(node, stub):
    node.contribute(7, False)
    replies = stream(
        stub,
        [
            dict(sync_key=7, src_rank=0, bool_val=True),  # the receiver's own rank
            dict(sync_key=7, src_rank=1, bool_val=True),
            dict(sync_key=9, src_rank=1),  # no value
        ],
    )
    assert [(r.handled, r.rejected_sync_key) for r in replies] == [(1, 7), (3, 9)]
    assert "src_rank 0 of sync key 7 is not a peer of rank 0" in replies[0].rejected
    assert "rank 1 for sync key 9 has no value" in replies[1].rejected
    send(stub, sync_key=7, src_rank=2, bool_val=False)
    assert node.get_result(7) is True
    assert node.stats().rejected == 2


def test_stream_acknowledges_every_few_messages(node, stub):
    count = 2 * ACK_EVERY + 1
    replies = stream(stub, [dict(sync_key=key, src_rank=1, uint64_val=key) for key in range(count)])
    assert [(r.handled, r.rejected) for r in replies] == [(ACK_EVERY, ""), (2 * ACK_EVERY, "")]
    assert node.stats().pending == count  # every key waits for rank 2 and the local value


def test_stream_of_a_closed_node_ends_unavailable():
    def receive(message):
        raise AllReduceClosedError("closed", sync_key=message.sync_key, rank=0)

    server = recording.serve(receive)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            with pytest.raises(grpc.RpcError) as info:
                stub = AllReduceStub(channel)
                stream(stub, [dict(sync_key=1, src_rank=1, bool_val=True)])
    finally:
        server.stop(0)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE and info.value.details() == "closed"
