"""The negotiation stream of one worker and generation (see the Negotiate RPC).

Split from :mod:`._client`, which opens it (:meth:`CoordinatorClient.open_stream`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import grpc

from hora_proto.v1 import negotiation_pb2, rendezvous_pb2

from .errors import CoordinatorUnavailableError
from .settings import Settings

__all__ = ["NegotiationStream", "stream_messages"]

_CLOSE = object()


class CoordinatorClient(Protocol):
    """What a stream uses of the client that opens it (``hora._client.CoordinatorClient``;
    a protocol, so this module does not import the one that imports it)."""

    @property
    def settings(self) -> Settings: ...
    @property
    def job_id(self) -> str: ...
    @property
    def worker_id(self) -> str: ...
    @property
    def _negotiation(self) -> Any: ...
    @property
    def _metadata(self) -> tuple[tuple[str, str], ...]: ...
    def _error(self, exc: grpc.RpcError, what: str) -> Exception: ...
# How a stream ends when the coordinator dies or the network drops (as
# opposed to a refusal such as FAILED_PRECONDITION).
_STREAM_BROKE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
})
# A burst of requests goes out in messages of about this many bytes at most: the
# coordinator refuses a message past its --max-message-bytes (4 MiB by default)
# by breaking the stream, which would lose this worker.
_BATCH_BYTES = 1024 * 1024


def stream_messages(items: queue.SimpleQueue[Any]) -> Iterator[negotiation_pb2.WorkerMessage]:
    """What goes on a negotiation stream, from what its callers queued, until ``_CLOSE``.

    Tensor requests queued while a send was under way go out as one RequestList
    (of about ``_BATCH_BYTES`` at most);
    a message queued whole (the open, a heartbeat) goes out as it is, in its
    place: after the requests queued before it, before those queued after.
    """
    while True:
        item = items.get()
        if item is _CLOSE:
            return
        if isinstance(item, negotiation_pb2.WorkerMessage):
            yield item
            continue
        batch = [item]
        size = item.ByteSize()
        after: object = None  # what ended the batch: a whole message, or the end
        while size < _BATCH_BYTES:
            try:
                more = items.get_nowait()
            except queue.Empty:
                break
            if more is _CLOSE or isinstance(more, negotiation_pb2.WorkerMessage):
                after = more
                break
            batch.append(more)
            size += more.ByteSize()
        yield negotiation_pb2.WorkerMessage(requests=negotiation_pb2.RequestList(requests=batch))
        if after is _CLOSE:
            return
        if isinstance(after, negotiation_pb2.WorkerMessage):
            yield after


class NegotiationStream:
    """The bidirectional negotiation stream of one worker and generation.

    Requests are queued by any thread and sent by gRPC's own sender thread;
    all requests queued while a send was under way go out as one message (up
    to about 1 MiB, then in the next), which is how a burst of ready
    gradients becomes one negotiation message.
    """

    def __init__(self, client: CoordinatorClient, generation: int,
                 received: Sequence[negotiation_pb2.ReceivedLists] = ()) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = threading.Event()
        open_msg = negotiation_pb2.WorkerMessage(open=negotiation_pb2.StreamOpen(
            job_id=client.job_id, worker_id=client.worker_id, generation=generation,
            received=received))
        self._queue.put(open_msg)
        self._client = client
        self._responses = client._negotiation.Negotiate(
            self._requests(), metadata=client._metadata)

    def _requests(self) -> Iterator[negotiation_pb2.WorkerMessage]:
        return stream_messages(self._queue)

    def send(self, request: negotiation_pb2.TensorRequest) -> None:
        """Queues one tensor request for the coordinator."""
        self._queue.put(request)

    def heartbeat(self, sequence: int,
                  telemetry: rendezvous_pb2.RankTelemetry | None = None) -> None:
        """Queues a heartbeat (with this rank's telemetry); its answer comes back on the
        stream, in order."""
        self._queue.put(negotiation_pb2.WorkerMessage(
            heartbeat=negotiation_pb2.StreamHeartbeat(sequence=sequence, telemetry=telemetry)))

    def __iter__(self) -> Iterator[negotiation_pb2.CoordinatorMessage]:
        """Yields coordinator messages until the stream ends.

        Raises:
            CoordinatorError: the stream broke (the coordinator died or refused us).
        """
        try:
            yield from self._responses
        except grpc.RpcError as exc:
            if self._closed.is_set() and exc.code() == grpc.StatusCode.CANCELLED:
                return
            if exc.code() in _STREAM_BROKE:  # the coordinator went away, not a refusal
                raise CoordinatorUnavailableError(
                    f"coordinator {self._client.settings.coordinator}: the negotiation stream "
                    f"broke ({exc.code()}): {exc.details()}") from exc
            raise self._client._error(exc, "negotiation stream") from exc

    def close(self) -> None:
        self._closed.set()
        self._queue.put(_CLOSE)
        self._responses.cancel()
