"""The `AllReduce` gRPC service: a thin adapter over the node's `receive`."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
from google.protobuf import empty_pb2

from parallel.allreduce import allreduce_pb2
from parallel.allreduce._admission import StreamRegistry
from parallel.allreduce._errors import AllReduceClosedError, UnauthenticatedError
from parallel.allreduce._tls import rank_of_identities

# Records one message. Its second argument is the only rank the message may
# come from (the sender's certificate, or the rank its stream was identified
# as), None for any. Returns the rank the message came from.
Receive = Callable[[allreduce_pb2.AllReduceData, int | None], int]

# A stream acknowledges every ACK_EVERY-th message. Each reply costs a send
# here and a receive plus a thread wake-up on the sender (measured: per-message
# replies made a 4-host round cost 1.7x the CPU of a round without them); the
# acknowledgements only let the sender forget values it would otherwise
# resend after a broken stream, where repeats are harmless.
ACK_EVERY = 64


class AllReduceServicer:
    """Hands every message to `receive` and turns its errors into status codes.

    `ValueError` (wrong rank, no value, a value of the other kind, a key out
    of range) becomes INVALID_ARGUMENT, `UnauthenticatedError` UNAUTHENTICATED,
    `AllReduceClosedError` UNAVAILABLE; repeated and late messages are
    accepted by `receive` and answered with OK. On a stream, a rejected or
    unauthenticated message is answered with a `ContributeReply` naming its
    key and the stream goes on; a closed node ends the stream with
    UNAVAILABLE. Streams are registered in `streams`, which ends the ones
    that are replaced or pushed out.

    Args:
      receive: records a message (see `Receive`).
      streams: the open streams of this server.
      tls: the server requires client certificates; each names its rank.
    """

    def __init__(self, receive: Receive, *, streams: StreamRegistry, tls: bool = False):
        self._receive = receive
        self._streams = streams
        self._tls = tls

    def ContributeData(self, request, context):  # noqa: N802 - the RPC's name
        try:
            self._receive(request, self._certified_rank(context))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except UnauthenticatedError as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
        except AllReduceClosedError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return empty_pb2.Empty()

    def ContributeStream(  # noqa: N802 - the RPC's name
        self, request_iterator, context
    ) -> Iterator[allreduce_pb2.ContributeReply]:
        slot = self._streams.open(context.cancel, self._certified_rank(context))
        try:
            handled = 0
            for request in request_iterator:
                handled += 1
                try:
                    rank = self._receive(request, slot.rank)
                except (ValueError, UnauthenticatedError) as e:
                    yield allreduce_pb2.ContributeReply(
                        handled=handled, rejected_sync_key=request.sync_key, rejected=str(e)
                    )
                    continue
                except AllReduceClosedError as e:
                    context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
                if slot.rank is None:
                    self._streams.identify(slot, rank)
                if handled % ACK_EVERY == 0:
                    yield allreduce_pb2.ContributeReply(handled=handled)
        finally:
            self._streams.close(slot)

    def _certified_rank(self, context) -> int | None:
        """The rank the client's certificate names; None without TLS."""
        if not self._tls:
            return None
        rank = rank_of_identities(context.peer_identities())
        if rank is None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "the client certificate names no single 'allreduce-rank-<r>' identity",
            )
        return rank
