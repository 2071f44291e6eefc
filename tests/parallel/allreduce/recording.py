"""Servers whose `AllReduce` service hands every message to a test's function."""

from __future__ import annotations

from collections.abc import Callable

from parallel.allreduce import BoundServer, bind_server
from parallel.allreduce._admission import StreamRegistry
from parallel.allreduce._servicer import AllReduceServicer

UNIDENTIFIED_STREAMS = 4


def serve(receive: Callable[[object], object], port: int = 0) -> BoundServer:
    """A started server on 127.0.0.1 that passes each message to `receive`.

    Every message counts as coming from the rank it claims. Stop it with
    `.stop(0)`.
    """

    def receive_any(message, expected_rank):
        receive(message)
        return message.src_rank

    server = bind_server(port, host="127.0.0.1")
    streams = StreamRegistry(UNIDENTIFIED_STREAMS)
    server.start(AllReduceServicer(receive_any, streams=streams), peers=1)
    return server
