"""The `AllReduce` service of allreduce.proto, bound with gRPC's generic API.

Only the messages are generated (allreduce_pb2). A method is its path and
the (de)serializers of its messages, so the two methods are bound here by
hand rather than through a generated gRPC module; a method added to the
proto must be added here too.
"""

from __future__ import annotations

import grpc
from google.protobuf import empty_pb2

from parallel.allreduce._servicer import AllReduceServicer
from parallel.allreduce.allreduce_pb2 import AllReduceData, ContributeReply

SERVICE = "sparseflow.allreduce.AllReduce"


def add_servicer(servicer: AllReduceServicer, server: grpc.Server) -> None:
    """Serves the service on `server` with `servicer`'s `ContributeData` and `ContributeStream`."""
    handlers = {
        "ContributeData": grpc.unary_unary_rpc_method_handler(
            servicer.ContributeData,
            request_deserializer=AllReduceData.FromString,
            response_serializer=empty_pb2.Empty.SerializeToString,
        ),
        "ContributeStream": grpc.stream_stream_rpc_method_handler(
            servicer.ContributeStream,
            request_deserializer=AllReduceData.FromString,
            response_serializer=ContributeReply.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


class AllReduceStub:
    """A client of one peer's service over `channel`.

    Attributes:
      ContributeData: the unary call, `AllReduceData -> Empty`.
      ContributeStream: the streaming call, `AllReduceData`s in, `ContributeReply`s out.
    """

    def __init__(self, channel: grpc.Channel):
        self.ContributeData = channel.unary_unary(  # noqa: N815 - the RPC's name
            f"/{SERVICE}/ContributeData",
            request_serializer=AllReduceData.SerializeToString,
            response_deserializer=empty_pb2.Empty.FromString,
        )
        self.ContributeStream = channel.stream_stream(  # noqa: N815 - the RPC's name
            f"/{SERVICE}/ContributeStream",
            request_serializer=AllReduceData.SerializeToString,
            response_deserializer=ContributeReply.FromString,
        )
