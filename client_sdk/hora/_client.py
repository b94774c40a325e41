"""The worker's side of the gRPC contract: join, leave, heartbeat, store, stream.

This is the one boundary where gRPC errors become hora errors: every call
goes through :meth:`CoordinatorClient._call`, which maps status codes to the
error tree in :mod:`hora.errors`, and every call has a deadline.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Protocol

import grpc

from hora_proto.auth import TOKEN_METADATA_KEY
from hora_proto.v1 import (
    negotiation_pb2,
    negotiation_pb2_grpc,
    rendezvous_pb2,
    rendezvous_pb2_grpc,
    store_pb2,
    store_pb2_grpc,
)

from .errors import (
    AuthenticationError,
    CoordinatorError,
    CoordinatorUnavailableError,
    InvalidCallError,
    RankLostError,
    RendezvousError,
    RendezvousTimeoutError,
    StallError,
)
from .settings import Settings

__all__ = ["CoordinatorClient", "NegotiationStream", "StoreKeyError", "stream_messages"]

log = logging.getLogger("hora.client")




# One identity per process: an elastic worker that re-joins after a reset is
# recognised by the coordinator as the same member, so it keeps its place.
PROCESS_WORKER_ID = uuid.uuid4().hex


class Stream(Protocol):
    """A negotiation stream as the engine uses it."""

    def send(self, request: negotiation_pb2.TensorRequest) -> None: ...

    def heartbeat(self, sequence: int) -> None: ...

    def __iter__(self) -> Iterator[negotiation_pb2.CoordinatorMessage]: ...

    def close(self) -> None: ...


class CoordinatorLink(Protocol):
    """What the engine asks of a coordinator: :class:`CoordinatorClient` over gRPC,
    or :class:`hora._solo.SoloClient` in a world of one."""

    def heartbeat(self, generation: int) -> rendezvous_pb2.HeartbeatResponse: ...

    def leave(self, reason: str = "shutdown", rejoin: bool = False) -> None: ...

    def add_process_set(self, generation: int, process_set_id: int, ranks: list[int],
                        invalid: str = "") -> None: ...

    def remove_process_set(self, generation: int, process_set_id: int,
                           invalid: str = "") -> None: ...

    def open_stream(self, generation: int) -> Stream: ...


class StoreKeyError(KeyError):
    """A store key did not appear before its deadline."""


def _seconds(value: timedelta) -> float:
    return max(value.total_seconds(), 0.001)


class CoordinatorClient:
    """One channel to the coordinator, shared by every call of this worker.

    Args:
        settings: where the coordinator is, which job, which token, deadlines.
    """

    def __init__(self, settings: Settings) -> None:
        if not settings.coordinator:
            raise CoordinatorError(
                "no coordinator address: start the script with horarun, or set "
                "HORA_COORDINATOR=HOST:PORT (and HORA_JOB_ID, HORA_TOKEN)")
        self.settings = settings
        self.job_id = settings.job_id
        self.worker_id = PROCESS_WORKER_ID
        self._metadata = ((TOKEN_METADATA_KEY, settings.token),)
        self._channel = grpc.insecure_channel(
            settings.coordinator,
            options=[
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_permit_without_calls", 1),
            ],
        )
        self._rendezvous = rendezvous_pb2_grpc.RendezvousStub(self._channel)
        self._store = store_pb2_grpc.StoreStub(self._channel)
        self._negotiation = negotiation_pb2_grpc.NegotiationStub(self._channel)

    # -- errors ------------------------------------------------------------

    def _error(self, exc: grpc.RpcError, what: str) -> Exception:
        code = exc.code() if hasattr(exc, "code") else None
        detail = exc.details() if hasattr(exc, "details") else str(exc)
        where = f"coordinator {self.settings.coordinator}"
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return AuthenticationError(f"{where} refused the job token during {what}: {detail}")
        if code == grpc.StatusCode.UNAVAILABLE:
            return CoordinatorUnavailableError(f"{where} is unreachable during {what}: {detail}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return CoordinatorUnavailableError(f"{where} did not answer {what} in time: {detail}")
        return CoordinatorError(f"{where}: {what} failed ({code}): {detail}")

    def _call(self, what: str, method: Callable[..., Any], request: Any,
              timeout: timedelta) -> Any:
        try:
            return method(request, timeout=_seconds(timeout), metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self._error(exc, what) from exc

    # -- rendezvous --------------------------------------------------------

    def wait_reachable(self) -> None:
        """Waits until the channel connects, at most the connect timeout.

        Raises:
            CoordinatorUnavailableError: nothing answered at the address.
        """
        timeout = self.settings.connect_timeout
        try:
            grpc.channel_ready_future(self._channel).result(timeout=_seconds(timeout))
        except grpc.FutureTimeoutError:
            raise CoordinatorUnavailableError(
                f"coordinator {self.settings.coordinator} could not be reached within "
                f"{timeout.total_seconds():g} s (HORA_CONNECT_TIMEOUT); is it running, and is "
                f"the address right?") from None

    def join(self) -> rendezvous_pb2.WorldView:
        """Joins the job and returns this worker's world view.

        Raises:
            RendezvousTimeoutError: the world did not gather within the start timeout.
            RendezvousError: the coordinator refused the join.
        """
        s = self.settings
        request = rendezvous_pb2.JoinRequest(
            job_id=s.job_id, worker_id=self.worker_id, host=s.hostname, pid=os.getpid(),
            expected_size=s.size, rank_hint=s.rank, data_plane_address=s.data_plane_address,
            fusion_threshold_bytes=s.fusion_threshold,
            stall_warning_ms=int(s.stall_warning_time.total_seconds() * 1000),
            stall_shutdown_ms=int(s.stall_shutdown_time.total_seconds() * 1000),
            min_size=s.min_size, max_size=s.max_size,
            elastic_timeout_ms=int(s.elastic_timeout.total_seconds() * 1000),
        )
        # An elastic round may wait up to the elastic timeout for enough workers.
        deadline, setting = s.start_timeout, "HORA_START_TIMEOUT"
        if s.is_elastic and s.elastic_timeout > deadline:
            deadline, setting = s.elastic_timeout, "HORA_ELASTIC_TIMEOUT"
        wanted = (f"at least {s.min_size or 1} workers" if s.is_elastic
                  else f"the world of {s.size} workers")
        try:
            response = self._rendezvous.Join(
                request, timeout=_seconds(deadline), metadata=self._metadata)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise RendezvousTimeoutError(
                    f"job {s.job_id!r}: {wanted} did not gather within "
                    f"{deadline.total_seconds():g} s ({setting})") from exc
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                raise RendezvousError(f"job {s.job_id!r}: join refused: {exc.details()}") from exc
            raise self._error(exc, "join") from exc
        return response.world

    def leave(self, reason: str = "shutdown", rejoin: bool = False) -> None:
        """Tells the coordinator this worker leaves on purpose (best effort).

        With ``rejoin`` it leaves this generation only (an elastic reset).
        """
        request = rendezvous_pb2.LeaveRequest(
            job_id=self.job_id, worker_id=self.worker_id, reason=reason, rejoin=rejoin)
        try:
            self._call("leave", self._rendezvous.Leave, request, timedelta(seconds=5))
        except CoordinatorError as exc:
            log.debug("leave failed: %s", exc)

    def heartbeat(self, generation: int) -> rendezvous_pb2.HeartbeatResponse:
        request = rendezvous_pb2.HeartbeatRequest(
            job_id=self.job_id, worker_id=self.worker_id, generation=generation)
        return self._call("heartbeat", self._rendezvous.Heartbeat, request,
                          max(self.settings.heartbeat_interval * 5, timedelta(seconds=2)))

    # -- store -------------------------------------------------------------

    def _store_call(self, what: str, method: Callable[..., Any], request: Any,
                    timeout: timedelta, keys: list[str]) -> Any:
        try:
            return method(request, timeout=_seconds(timeout) + 5.0, metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND):
                raise StoreKeyError(
                    f"store {what}: key(s) {keys} not set within "
                    f"{timeout.total_seconds():g} s: {exc.details()}") from exc
            raise self._error(exc, f"store {what}") from exc

    def store_set(self, key: str, value: bytes) -> None:
        self._call("store set", self._store.Set,
                   store_pb2.StoreSetRequest(job_id=self.job_id, key=key, value=value),
                   self.settings.connect_timeout)

    def store_get(self, key: str, timeout: timedelta) -> bytes:
        request = store_pb2.StoreGetRequest(
            job_id=self.job_id, key=key, timeout_ms=int(timeout.total_seconds() * 1000))
        return self._store_call("get", self._store.Get, request, timeout, [key]).value

    def store_add(self, key: str, amount: int) -> int:
        request = store_pb2.StoreAddRequest(job_id=self.job_id, key=key, amount=amount)
        return self._call("store add", self._store.Add, request,
                          self.settings.connect_timeout).value

    def store_wait(self, keys: list[str], timeout: timedelta) -> None:
        request = store_pb2.StoreWaitRequest(
            job_id=self.job_id, keys=keys, timeout_ms=int(timeout.total_seconds() * 1000))
        self._store_call("wait", self._store.Wait, request, timeout, keys)

    def store_compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        request = store_pb2.StoreCompareSetRequest(
            job_id=self.job_id, key=key, expected=expected, desired=desired)
        return self._call("store compare_set", self._store.CompareSet, request,
                          self.settings.connect_timeout).value

    def store_delete(self, key: str) -> bool:
        request = store_pb2.StoreDeleteRequest(job_id=self.job_id, key=key)
        return self._call("store delete", self._store.Delete, request,
                          self.settings.connect_timeout).existed

    # -- negotiation ---------------------------------------------------------

    def add_process_set(self, generation: int, process_set_id: int, ranks: list[int],
                        invalid: str = "") -> None:
        """This rank's call of the collective AddProcessSet (see :meth:`_set_call`)."""
        request = negotiation_pb2.AddProcessSetRequest(
            job_id=self.job_id, worker_id=self.worker_id, generation=generation,
            process_set_id=process_set_id, ranks=ranks, invalid=invalid)
        self._set_call("add_process_set", self._negotiation.AddProcessSet, request)

    def remove_process_set(self, generation: int, process_set_id: int,
                           invalid: str = "") -> None:
        """This rank's call of the collective RemoveProcessSet (see :meth:`_set_call`)."""
        request = negotiation_pb2.RemoveProcessSetRequest(
            job_id=self.job_id, worker_id=self.worker_id, generation=generation,
            process_set_id=process_set_id, invalid=invalid)
        self._set_call("remove_process_set", self._negotiation.RemoveProcessSet, request)

    def _set_call(self, what: str, method: Callable[..., Any], request: Any) -> None:
        """A process set call: answered once every rank has called, alike on every rank.

        The coordinator fails the call when some rank has not called within the
        job's stall shutdown time; this call's own deadline is a little longer,
        or the collective timeout when the stall shutdown is off.

        Raises:
            InvalidCallError: some rank's call was invalid, or the calls differ
                (the coordinator's message, the same on every rank).
            StallError: some rank did not call in time.
            RankLostError: a rank left or was lost, or the generation ended.
            CoordinatorError: the coordinator could not be reached.
        """
        s = self.settings
        timeout = (s.stall_shutdown_time + s.connect_timeout if s.stall_shutdown_time
                   else s.collective_timeout)
        start = time.monotonic()
        try:
            method(request, timeout=_seconds(timeout), metadata=self._metadata)
        except grpc.RpcError as exc:
            code, detail = exc.code(), exc.details()
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidCallError(detail) from exc
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                raise RankLostError(detail) from exc
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                if time.monotonic() - start >= timeout.total_seconds():  # our own deadline
                    detail = (f"{what} was not answered within {timeout.total_seconds():g} s: "
                              f"some rank did not call it")
                raise StallError(detail) from exc
            raise self._error(exc, what) from exc

    def open_stream(self, generation: int) -> NegotiationStream:
        return NegotiationStream(self, generation)

    def close(self) -> None:
        self._channel.close()


_CLOSE = object()


def stream_messages(items: queue.SimpleQueue[Any]) -> Iterator[negotiation_pb2.WorkerMessage]:
    """What goes on a negotiation stream, from what its callers queued, until ``_CLOSE``.

    Tensor requests queued while a send was under way go out as one RequestList;
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
        after: object = None  # what ended the batch: a whole message, or the end
        while True:
            try:
                more = items.get_nowait()
            except queue.Empty:
                break
            if more is _CLOSE or isinstance(more, negotiation_pb2.WorkerMessage):
                after = more
                break
            batch.append(more)
        yield negotiation_pb2.WorkerMessage(requests=negotiation_pb2.RequestList(requests=batch))
        if after is _CLOSE:
            return
        if isinstance(after, negotiation_pb2.WorkerMessage):
            yield after


class NegotiationStream:
    """The bidirectional negotiation stream of one worker and generation.

    Requests are queued by any thread and sent by gRPC's own sender thread;
    all requests queued while a send was under way go out as one message,
    which is how a burst of ready gradients becomes one negotiation message.
    """

    def __init__(self, client: CoordinatorClient, generation: int) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = threading.Event()
        open_msg = negotiation_pb2.WorkerMessage(open=negotiation_pb2.StreamOpen(
            job_id=client.job_id, worker_id=client.worker_id, generation=generation))
        self._queue.put(open_msg)
        self._client = client
        self._responses = client._negotiation.Negotiate(
            self._requests(), metadata=client._metadata)

    def _requests(self) -> Iterator[negotiation_pb2.WorkerMessage]:
        return stream_messages(self._queue)

    def send(self, request: negotiation_pb2.TensorRequest) -> None:
        """Queues one tensor request for the coordinator."""
        self._queue.put(request)

    def heartbeat(self, sequence: int) -> None:
        """Queues a heartbeat; its answer comes back on the stream, in order."""
        self._queue.put(negotiation_pb2.WorkerMessage(
            heartbeat=negotiation_pb2.StreamHeartbeat(sequence=sequence)))

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
            raise self._client._error(exc, "negotiation stream") from exc

    def close(self) -> None:
        self._closed.set()
        self._queue.put(_CLOSE)
        self._responses.cancel()
