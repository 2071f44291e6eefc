"""The `AllReduce` gRPC service: a thin adapter over the node's `receive`."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from google.protobuf import empty_pb2

from parallel.allreduce import allreduce_pb2, allreduce_pb2_grpc
from parallel.allreduce._errors import AllReduceClosedError

Receive = Callable[[allreduce_pb2.AllReduceData], object]


class AllReduceServicer(allreduce_pb2_grpc.AllReduceServicer):
    """Hands every message to `receive` and turns its errors into status codes.

    `ValueError` (wrong rank, no value, a value of the other kind) becomes
    INVALID_ARGUMENT, `AllReduceClosedError` becomes UNAVAILABLE; repeated and
    late messages are accepted by `receive` and answered with OK.
    """

    def __init__(self, receive: Receive):
        self._receive = receive

    def ContributeData(self, request, context):  # noqa: N802 - the RPC's name
        try:
            self._receive(request)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except AllReduceClosedError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return empty_pb2.Empty()
