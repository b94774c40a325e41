"""gRPC adapters: thin servicers over :class:`~.coordinator.Coordinator`.

This module is the one place coordinator errors become gRPC status codes
(:func:`status_for`). Servicers translate requests into coordinator calls and
do nothing else; messages become domain objects and back through :mod:`.wire`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from hora_proto.auth import TOKEN_METADATA_KEY, worker_secret
from hora_proto.error_kinds import ERROR_KIND_METADATA_KEY
from hora_proto.v1 import (
    negotiation_pb2,
    negotiation_pb2_grpc,
    rendezvous_pb2,
    rendezvous_pb2_grpc,
    store_pb2,
    store_pb2_grpc,
)

from . import wire
from .coordinator import STREAM_END, Coordinator
from .errors import (
    AlreadyOpenError,
    AuthenticationError,
    CallTimeoutError,
    CoordinatorError,
    InvalidRequestError,
    KeyTimeoutError,
    OutOfRangeError,
    PermissionDeniedError,
    PreconditionError,
    ResourceExhaustedError,
    SupersededError,
    UnknownError,
)
from .limits import check_printable_ids, shown_id
from .scopes import join_allowed, metadata_value

__all__ = [
    "DETAILS_BUDGET_BYTES",
    "NegotiationServicer",
    "RendezvousServicer",
    "StoreServicer",
    "abort_with",
    "add_servicers",
    "status_details",
    "status_for",
]

logger = logging.getLogger("hora_coordinator")

# Most specific first: status_for walks it in order.
_STATUS: tuple[tuple[type[CoordinatorError], grpc.StatusCode], ...] = (
    (AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (OutOfRangeError, grpc.StatusCode.OUT_OF_RANGE),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnknownError, grpc.StatusCode.NOT_FOUND),
    (PreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (AlreadyOpenError, grpc.StatusCode.ALREADY_EXISTS),
    (SupersededError, grpc.StatusCode.ABORTED),
    (KeyTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (CallTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
)


#: Most bytes the details of a status take on the wire. They travel in the
#: ``grpc-message`` trailer, percent-encoded (3 bytes for each byte outside
#: printable ASCII); a trailer past the caller's metadata limit (16 KiB hard,
#: 8 KiB soft by default) reaches it as RESOURCE_EXHAUSTED "received metadata
#: size exceeds hard limit" instead of the refusal.
DETAILS_BUDGET_BYTES = 4096


def status_details(text: str) -> str:
    """``text`` cut ("…") to fit :data:`DETAILS_BUDGET_BYTES` once percent-encoded.

    Messages quote what callers sent (ids, keys, reasons); however long that
    was, the caller gets the status code and the start of the message.
    """
    budget = DETAILS_BUDGET_BYTES - 9  # room for "…" (3 bytes, each encoded)
    used = 0
    for i, char in enumerate(text):
        used += 1 if " " <= char <= "~" and char != "%" else 3 * len(
            char.encode("utf-8", "surrogatepass"))
        if used > budget:
            return text[:i] + "…"
    return text


def status_for(error: CoordinatorError) -> grpc.StatusCode:
    """The gRPC status code for a coordinator error (INTERNAL for an unmapped one)."""
    for kind, code in _STATUS:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


async def abort_with(context: grpc.aio.ServicerContext, error: CoordinatorError) -> None:
    """Ends the call with ``error``'s status code and message, cut to fit a trailer
    (:func:`status_details`), and its kind, if any, in the trailing metadata;
    raises, as abort does."""
    trailing = ((ERROR_KIND_METADATA_KEY, error.kind),) if error.kind else ()
    await context.abort(status_for(error), status_details(str(error)), trailing)


_F = TypeVar("_F", bound=Callable[..., Awaitable[Any]])


def _mapped(method: _F) -> _F:
    """Turns CoordinatorError raised by a servicer method into its status code."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            check_printable_ids(request)
            return await method(self, request, context)
        except CoordinatorError as exc:
            await abort_with(context, exc)

    return wrapper  # type: ignore[return-value]


class RendezvousServicer(rendezvous_pb2_grpc.RendezvousServicer):
    """hora.v1.Rendezvous over a Coordinator."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._c = coordinator

    @_mapped
    async def Join(self, request, context):  # noqa: N802 (gRPC method names)
        admin = self._c.settings.token
        metadata = context.invocation_metadata()
        if metadata_value(metadata, TOKEN_METADATA_KEY) != admin:  # a job token (auth checked it)
            job = self._c.jobs.get(request.job_id)
            is_member = job is not None and request.worker_id in job.by_worker
            join_allowed(admin, request.job_id, request.worker_id, is_member, metadata)
        response = wire.join_response_pb(await self._c.join(wire.join_request(request)))
        response.worker_secret = worker_secret(admin, request.job_id, request.worker_id)
        return response

    @_mapped
    async def Leave(self, request, context):  # noqa: N802
        self._c.leave(request.job_id, request.worker_id, request.reason, request.rejoin)
        return rendezvous_pb2.LeaveResponse()

    @_mapped
    async def Heartbeat(self, request, context):  # noqa: N802
        return wire.heartbeat_pb(self._c.heartbeat(
            request.job_id, request.worker_id, wire.rank_telemetry(request)))

    @_mapped
    async def GetWorld(self, request, context):  # noqa: N802
        view = self._c.get_world(request.job_id, request.worker_id)
        return wire.join_response_pb(wire.world_view_pb(view))

    @_mapped
    async def ReportEvent(self, request, context):  # noqa: N802
        self._c.report_event(request.job_id, request.kind, request.host, request.message)
        return rendezvous_pb2.ReportEventResponse()

    @_mapped
    async def ListEvents(self, request, context):  # noqa: N802
        return wire.list_events_response_pb(self._c.list_events(request.job_id))

    @_mapped
    async def Reattach(self, request, context):  # noqa: N802
        restored = self._c.reattach(wire.reattach_request(request))
        return rendezvous_pb2.ReattachResponse(restored=restored)


class StoreServicer(store_pb2_grpc.StoreServicer):
    """hora.v1.Store over the coordinator's per-job stores."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._c = coordinator

    @_mapped
    async def Set(self, request, context):  # noqa: N802
        self._c.store(request.job_id).set(request.key, request.value)
        return store_pb2.StoreSetResponse()

    @_mapped
    async def Get(self, request, context):  # noqa: N802
        value = await self._c.store(request.job_id).get(request.key, request.timeout_ms / 1000.0)
        return store_pb2.StoreGetResponse(value=value)

    @_mapped
    async def Add(self, request, context):  # noqa: N802
        value = self._c.store(request.job_id).add(request.key, request.amount)
        return store_pb2.StoreAddResponse(value=value)

    @_mapped
    async def Wait(self, request, context):  # noqa: N802
        await self._c.store(request.job_id).wait(list(request.keys), request.timeout_ms / 1000.0)
        return store_pb2.StoreWaitResponse()

    @_mapped
    async def CompareSet(self, request, context):  # noqa: N802
        value = self._c.store(request.job_id).compare_set(
            request.key, request.expected, request.desired
        )
        return store_pb2.StoreCompareSetResponse(value=value)

    @_mapped
    async def Delete(self, request, context):  # noqa: N802
        existed = self._c.store(request.job_id).delete(request.key)
        return store_pb2.StoreDeleteResponse(existed=existed)


class NegotiationServicer(negotiation_pb2_grpc.NegotiationServicer):
    """hora.v1.Negotiation: a stream per member and generation, and process set calls.

    A reader task feeds incoming request lists to the coordinator; this
    coroutine drains the member's outbox onto the stream. Whichever way the
    stream ends (client half-close, cancel, error), the coordinator hears of
    it exactly once through ``stream_closed``.
    """

    def __init__(self, coordinator: Coordinator) -> None:
        self._c = coordinator

    @_mapped
    async def Negotiate(self, request_iterator, context):  # noqa: N802
        first = await _first_message(request_iterator)
        if first is None or first.WhichOneof("kind") != "open":
            raise InvalidRequestError("the first message of a negotiation stream must be `open`")
        job_id, worker_id, generation = (
            first.open.job_id,
            first.open.worker_id,
            first.open.generation,
        )
        outbox = self._c.open_stream(job_id, worker_id, generation,
                                     wire.received_lists(first.open))
        # A client that does not read fills its outbox: drop it (the finally below).
        outbox.on_overflow(_dropper(asyncio.current_task(), job_id, worker_id, outbox.limit))
        coordinator = self._c
        die_after = coordinator.settings.test_die_after_list
        refused: list[CoordinatorError] = []

        async def read() -> None:
            try:
                async for message in request_iterator:
                    kind = message.WhichOneof("kind")
                    if kind == "requests":
                        requests = wire.tensor_requests(message.requests)
                        coordinator.requests(job_id, worker_id, generation, requests)
                    elif kind == "heartbeat":
                        coordinator.stream_heartbeat(
                            job_id, worker_id, generation, message.heartbeat.sequence,
                            wire.rank_telemetry(message.heartbeat),
                        )
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass  # the stream broke: treated below as closed
            except CoordinatorError as exc:  # a message that does not decode: end the stream
                refused.append(exc)
            except Exception:  # a coordinator bug: end this stream loudly, keep serving
                logger.exception(
                    "negotiation stream of worker %s in job '%s' failed", worker_id, job_id
                )
            finally:
                outbox.put_nowait(STREAM_END)

        reader = asyncio.create_task(read())
        try:
            while True:
                message = await outbox.get()
                if message is STREAM_END:
                    break
                if die_after and _is_list(message, die_after):
                    await self._die_after_rank_0(job_id, worker_id, message, context)
                await context.write(message)
        except asyncio.CancelledError:
            if not outbox.overflowed:
                raise
            refused.append(ResourceExhaustedError(
                f"this stream had {outbox.limit} messages waiting that its client did not "
                "read (max_stream_queue); dropped"))
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            self._c.stream_closed(job_id, worker_id, generation)
        if refused:
            raise refused[0]

    async def _die_after_rank_0(self, job_id: str, worker_id: str,
                                message: negotiation_pb2.CoordinatorMessage,
                                context: grpc.aio.ServicerContext) -> None:
        """The test-only fault (``--test-die-after-list``): the list goes to rank 0,
        then the process exits; any other rank's stream holds it back until then."""
        job = self._c.jobs.get(job_id)
        member = job.by_worker.get(worker_id) if job is not None else None
        if member is None or member.rank != 0:
            await asyncio.Event().wait()  # never set: the process exits first
        await context.write(message)
        await asyncio.sleep(0.5)  # let gRPC flush it onto the socket
        logger.critical("test hook: exiting after delivering response list %d to rank 0 "
                        "only (--test-die-after-list)", message.responses.number)
        logging.shutdown()
        os._exit(70)

    @_mapped
    async def AddProcessSet(self, request, context):  # noqa: N802
        await self._c.add_process_set(wire.add_process_set_request(request))
        return negotiation_pb2.AddProcessSetResponse()

    @_mapped
    async def RemoveProcessSet(self, request, context):  # noqa: N802
        await self._c.remove_process_set(wire.remove_process_set_request(request))
        return negotiation_pb2.RemoveProcessSetResponse()


def _dropper(task: asyncio.Task[Any] | None, job_id: str, worker_id: str,
             limit: int) -> Callable[[], None]:
    def drop() -> None:
        logger.warning("job '%s': worker %s reads nothing of its negotiation stream (%d messages "
                       "waiting, max_stream_queue); dropped", shown_id(job_id),
                       shown_id(worker_id), limit)
        if task is not None:
            task.cancel()
    return drop


def _is_list(message: object, number: int) -> bool:
    """Whether ``message`` is the global set's response list ``number``."""
    return (isinstance(message, negotiation_pb2.CoordinatorMessage)
            and message.WhichOneof("kind") == "responses"
            and message.responses.number == number
            and all(r.process_set_id == 0 for r in message.responses.responses))


async def _first_message(request_iterator: Any) -> negotiation_pb2.WorkerMessage | None:
    try:
        return await request_iterator.__anext__()
    except StopAsyncIteration:
        return None


def add_servicers(server: grpc.aio.Server, coordinator: Coordinator) -> None:
    """Mounts Rendezvous, Store and Negotiation on ``server``."""
    rendezvous_pb2_grpc.add_RendezvousServicer_to_server(RendezvousServicer(coordinator), server)
    store_pb2_grpc.add_StoreServicer_to_server(StoreServicer(coordinator), server)
    negotiation_pb2_grpc.add_NegotiationServicer_to_server(NegotiationServicer(coordinator), server)
