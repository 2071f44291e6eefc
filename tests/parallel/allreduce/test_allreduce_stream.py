"""`PeerStream` against a real recording server: reconnects, resends, expiry, close."""

import queue
import time

import grpc
import pytest
import recording

from parallel.allreduce import allreduce_pb2 as pb
from parallel.allreduce import bind_server
from parallel.allreduce._admission import StreamRegistry
from parallel.allreduce._servicer import AllReduceServicer
from parallel.allreduce._stream import PeerStream

RECEIVE_TIMEOUT_S = 30


def recording_server(port=0):
    """A server that accepts every message and records it, and its record."""
    received = queue.Queue()
    return recording.serve(received.put, port), received


def keys(received, count):
    return [received.get(timeout=RECEIVE_TIMEOUT_S).sync_key for _ in range(count)]


def message(key):
    return pb.AllReduceData(sync_key=key, src_rank=1, bool_val=True)


@pytest.fixture
def peer():
    server, received = recording_server()
    address = f"127.0.0.1:{server.port}"
    channel = grpc.insecure_channel(address)
    rejected = []
    stream = PeerStream(
        channel=channel,
        peer_rank=1,
        address=address,
        on_rejected=lambda *args: rejected.append(args),
    )
    servers = [server]
    yield stream, servers, received, rejected
    stream.close_requests()
    stream.join(time.monotonic())
    channel.close()
    for server in servers:
        server.stop(0)


def test_a_restarted_peer_gets_the_unacknowledged_values_again(peer):
    stream, servers, received, rejected = peer
    far = time.monotonic() + 60
    soon = time.monotonic() + 0.5
    stream.send(message(1), far)
    stream.send(message(2), soon)
    assert keys(received, 2) == [1, 2]
    time.sleep(max(soon - time.monotonic(), 0) + 0.05)  # key 2 expires unacknowledged
    port = servers[0].port
    servers[0].stop(0)  # the stream breaks
    server, received_again = recording_server(port)
    servers.append(server)
    stream.send(message(3), far)
    # Key 1 is resent (the peer ignores repeats); key 2 expired, so it is not.
    assert keys(received_again, 2) == [1, 3]
    assert stream.failures == 1 and rejected == []


def test_a_rejected_value_is_reported_and_the_stream_goes_on(peer):
    stream, servers, received, rejected = peer
    servers[0].stop(0)

    def receive(message):
        if message.sync_key == 5:
            raise ValueError("key 5 is bad")
        received.put(message)

    server = recording.serve(receive, servers[0].port)
    servers.append(server)
    far = time.monotonic() + 60
    for key in (4, 5, 6):
        stream.send(message(key), far)
    assert keys(received, 2) == [4, 6]
    stream.close_requests()
    stream.join(far)  # the peer answered everything, rejection included
    assert rejected == [(5, 1, "key 5 is bad")] and stream.failures == 1


def test_close_delivers_what_was_queued_to_a_peer_that_starts_late():
    first, _ = recording_server()
    port = first.port
    first.stop(0)  # nothing listens on the port until the peer starts
    address = f"127.0.0.1:{port}"
    rejected = []
    with grpc.insecure_channel(address) as channel:
        stream = PeerStream(
            channel=channel,
            peer_rank=1,
            address=address,
            on_rejected=lambda *args: rejected.append(args),
        )
        stream.send(message(8), time.monotonic() + 60)
        server, received = recording_server(port)
        try:
            stream.close_requests()
            stream.join(time.monotonic() + RECEIVE_TIMEOUT_S)
            assert keys(received, 1) == [8]
        finally:
            server.stop(0)
    assert stream.failures == 0 and rejected == []


class CountingServicer(AllReduceServicer):
    """Records every message and counts the streams opened to it."""

    def __init__(self):
        self.received = queue.Queue()
        self.streams = 0

        def receive(message, expected_rank):
            self.received.put(message)
            return message.src_rank

        super().__init__(receive, streams=StreamRegistry(4))

    def ContributeStream(self, request_iterator, context):  # noqa: N802 - the RPC's name
        self.streams += 1
        yield from super().ContributeStream(request_iterator, context)


def test_a_stream_with_nothing_to_resend_reopens_on_the_next_send(peer):
    stream, servers, received, rejected = peer
    stream.send(message(1), time.monotonic() + 0.3)
    assert keys(received, 1) == [1]
    time.sleep(0.4)  # key 1 expires unacknowledged: nothing is left to resend
    port = servers[0].port
    servers[0].stop(0)  # the stream breaks
    servicer = CountingServicer()
    server = bind_server(port, host="127.0.0.1")
    server.start(servicer, peers=1)
    servers.append(server)
    time.sleep(1.5)  # longer than the sender's longest backoff
    assert servicer.streams == 0  # an empty stream would sit unidentified at the peer
    stream.send(message(2), time.monotonic() + 60)
    assert servicer.received.get(timeout=RECEIVE_TIMEOUT_S).sync_key == 2
    assert servicer.streams == 1 and stream.failures == 1 and rejected == []
