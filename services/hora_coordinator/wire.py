"""The wire adapter: the coordinator's domain objects to and from ``hora.v1`` protobuf.

The transitions (:mod:`.state`, :mod:`hora_negotiation`) speak the plain
dataclasses of :mod:`.messages` and :mod:`.state.views`; the servicer and the
coordinator's executor call this module, and only this module, to turn
requests off the wire into those and answers back into stubs. Field names are
the same on both sides and enum numbers equal, so each conversion is a field
by field copy.

Tensor requests are the one type not converted: the negotiation table reads
the ``hora.v1.TensorRequest`` messages as they arrive (see
:mod:`hora_negotiation.messages`). The negotiation's answers are encoded by
:mod:`hora_negotiation.wire` (:func:`response_pb`, :func:`tensor_request_pb`),
which a world of one shares, and re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from hora_negotiation.wire import response_pb, tensor_request_pb
from hora_proto.options import LEGACY_JOIN_FIELDS, OptionError, legacy_join_fields
from hora_proto.v1 import negotiation_pb2 as npb
from hora_proto.v1 import rendezvous_pb2 as rpb

from .errors import InvalidRequestError
from .messages import (
    AddProcessSetRequest,
    CoordinatorMessage,
    ErrorKind,
    Event,
    JoinRequest,
    ReattachRequest,
    ReceivedLists,
    RemoveProcessSetRequest,
    ReportedMember,
    Response,
    ResponseList,
    ResponseType,
    TensorRequest,
)
from .state.job import JobEvent, MemberState
from .state.telemetry import RankTelemetry
from .state.views import HeartbeatReply, WorldMember, WorldView

__all__ = [
    "ViewTemplates",
    "add_process_set_request",
    "coordinator_message_pb",
    "event_pb",
    "heartbeat_pb",
    "join_request",
    "join_response_pb",
    "reattach_request",
    "received_lists",
    "list_events_response_pb",
    "rank_telemetry",
    "remove_process_set_request",
    "response_pb",
    "tensor_request_pb",
    "tensor_requests",
    "world_view_pb",
]

_MEMBER_STATE_PB = {
    MemberState.JOINING: rpb.MEMBER_STATE_JOINING,
    MemberState.ACTIVE: rpb.MEMBER_STATE_ACTIVE,
    MemberState.LEFT: rpb.MEMBER_STATE_LEFT,
    MemberState.LOST: rpb.MEMBER_STATE_LOST,
}

# ---- incoming ---------------------------------------------------------------------------

# Counters above this are a client's nonsense, not training (2**53: exact as a JSON number).
_COUNT_LIMIT = 1 << 53
# Seconds, rates and milliseconds above this likewise.
_FLOAT_LIMIT = 1e12


def _count(value: int) -> int:
    return min(max(value, 0), _COUNT_LIMIT)


def _amount(value: float) -> float:
    # NaN fails both comparisons: it becomes 0.
    return value if 0.0 <= value <= _FLOAT_LIMIT else (_FLOAT_LIMIT if value > 0 else 0.0)


def rank_telemetry(owner: rpb.HeartbeatRequest | npb.StreamHeartbeat) -> RankTelemetry | None:
    """The telemetry a heartbeat carried (None if none), clamped to sane ranges:
    it is shown and summed, never trusted."""
    if not owner.HasField("telemetry"):
        return None
    t = owner.telemetry
    rounds = _count(t.rounds)
    return RankTelemetry(
        steps=_count(t.steps),
        last_step_s=_amount(t.last_step_s),
        steps_per_s=_amount(t.steps_per_s),
        batch_size=_count(t.batch_size),
        rounds=rounds,
        lateness_p50_ms=_amount(t.lateness_p50_ms),
        lateness_p95_ms=_amount(t.lateness_p95_ms),
        last_arrivals=min(_count(t.last_arrivals), rounds),
        cache_hits=_count(t.cache_hits),
        cache_misses=_count(t.cache_misses),
    )


# Durations a caller sets, in milliseconds: at most about 31 years.
_MS_LIMIT = 10**12


def _bounded(what: str, value: int, limit: int) -> int:
    """``value`` if within ``[0, limit]``, else INVALID_ARGUMENT: the coordinator keeps
    it and counts from it (a generation or an epoch of 2**63 - 1 would overflow int64
    at the next increment)."""
    if not 0 <= value <= limit:
        raise InvalidRequestError(f"{what} {value} is outside [0, {limit}]")
    return value


# Longest text a job option's name or value may have (a number or a short word),
# and how many options a Join may carry (the table has a dozen).
_OPTION_TEXT_LIMIT = 64
_OPTION_COUNT_LIMIT = 64


def _job_fields(message: rpb.JoinRequest) -> dict[str, Any]:
    """The job's settings of a Join: read from ``job_options`` when the worker sent
    them (the deprecated fields 8..13 otherwise, as they came).

    Raises:
        InvalidRequestError: too many options, a name or value too long, or a value
            of an option this coordinator acts on that does not parse.
    """
    if not message.job_options:
        return {name: getattr(message, name) for name in LEGACY_JOIN_FIELDS}
    options = dict(message.job_options)
    if len(options) > _OPTION_COUNT_LIMIT:
        raise InvalidRequestError(f"a Join carries at most {_OPTION_COUNT_LIMIT} job options, "
                                  f"not {len(options)}")
    for key, text in options.items():
        # A key this coordinator does not know is a newer worker's option: kept
        # as it came (the REST view shows it), not acted on.
        if len(key) > _OPTION_TEXT_LIMIT or not key.isprintable():
            raise InvalidRequestError(f"job option name {key[:64]!r} is too long or "
                                      f"not printable")
        if len(text) > _OPTION_TEXT_LIMIT:
            raise InvalidRequestError(f"job option {key} is longer than "
                                      f"{_OPTION_TEXT_LIMIT} characters")
    try:
        fields: dict[str, Any] = legacy_join_fields(options)
    except OptionError as exc:
        raise InvalidRequestError(f"job option {exc}") from None
    fields["job_options"] = options
    return fields


def join_request(message: rpb.JoinRequest) -> JoinRequest:
    """A Join's request as the transitions read it; refuses values out of range.

    Raises:
        InvalidRequestError: a size, a duration or the fusion threshold is negative
            or absurdly large, or a job option cannot be read.
    """
    job = _job_fields(message)
    _bounded("fusion_threshold_bytes", job["fusion_threshold_bytes"], _COUNT_LIMIT)
    for what in ("stall_warning_ms", "stall_shutdown_ms", "elastic_timeout_ms"):
        _bounded(what, job[what], _MS_LIMIT)
    for what, size in (("min_size", job["min_size"]), ("max_size", job["max_size"]),
                       ("pid", message.pid)):
        _bounded(what, size, (1 << 31) - 1)
    return JoinRequest(
        job_id=message.job_id,
        worker_id=message.worker_id,
        host=message.host,
        pid=message.pid,
        expected_size=message.expected_size,
        rank_hint=message.rank_hint,
        data_plane_address=message.data_plane_address,
        **job,
    )


def reattach_request(message: rpb.ReattachRequest) -> ReattachRequest:
    """A Reattach's report as the transitions read it; refuses values out of range.

    Raises:
        InvalidRequestError: the generation, the host-change epoch or a rank is
            negative or past :data:`_COUNT_LIMIT` (2**53).
    """
    world = message.world
    _bounded("generation", world.generation, _COUNT_LIMIT)
    _bounded("host_update_epoch", message.host_update_epoch, _COUNT_LIMIT)
    _bounded("rank", world.rank, (1 << 31) - 1)
    for member in world.members:
        _bounded("member rank", member.rank, (1 << 31) - 1)
        _bounded("member pid", member.pid, (1 << 31) - 1)
    return ReattachRequest(
        join=join_request(message.join),
        generation=world.generation,
        rank=world.rank,
        members=tuple(
            ReportedMember(m.rank, m.worker_id, m.host, m.pid, m.data_plane_address)
            for m in world.members
        ),
        process_sets={s.process_set_id: tuple(s.ranks) for s in message.process_sets},
        host_update_epoch=message.host_update_epoch,
    )


def add_process_set_request(message: npb.AddProcessSetRequest) -> AddProcessSetRequest:
    """An AddProcessSet call as the transitions read it."""
    return AddProcessSetRequest(
        job_id=message.job_id,
        worker_id=message.worker_id,
        generation=message.generation,
        process_set_id=message.process_set_id,
        ranks=tuple(message.ranks),
        invalid=message.invalid,
    )


def remove_process_set_request(message: npb.RemoveProcessSetRequest) -> RemoveProcessSetRequest:
    """A RemoveProcessSet call as the transitions read it."""
    return RemoveProcessSetRequest(
        job_id=message.job_id,
        worker_id=message.worker_id,
        generation=message.generation,
        process_set_id=message.process_set_id,
        invalid=message.invalid,
    )


def received_lists(message: npb.StreamOpen) -> tuple[ReceivedLists, ...]:
    """What a worker opening its stream reports it has received, per process set."""
    return tuple(
        ReceivedLists(
            process_set_id=r.process_set_id,
            last_number=r.last_number,
            recent=tuple(_response_list(lst) for lst in r.recent),
        )
        for r in message.received
    )


def _response_list(message: npb.ResponseList) -> ResponseList:
    return ResponseList(
        responses=tuple(
            Response(
                type=ResponseType(r.type),
                tensor_names=tuple(r.tensor_names),
                process_set_id=r.process_set_id,
                first_dims=tuple(r.first_dims),
                splits=tuple(r.splits),
                error_message=r.error_message,
                error_kind=ErrorKind(r.error_kind),
                join_fill=tuple(r.join_fill),  # requests as they are (see the docstring)
                last_joined_rank=r.last_joined_rank,
            )
            for r in message.responses
        ),
        number=message.number,
    )


def tensor_requests(message: npb.RequestList) -> Sequence[TensorRequest]:
    """The requests of a RequestList, as they are (they satisfy :class:`TensorRequest`)."""
    return message.requests


# ---- outgoing: rendezvous ---------------------------------------------------------------


def _member_pb(member: WorldMember) -> rpb.Member:
    return rpb.Member(
        rank=member.rank,
        worker_id=member.worker_id,
        host=member.host,
        pid=member.pid,
        state=_MEMBER_STATE_PB[member.state],
        data_plane_address=member.data_plane_address,
        local_rank=member.local_rank,
        last_heartbeat_unix_ms=member.last_heartbeat_unix_ms,
    )


#: What :func:`world_view_pb` shares between the views of one world.
ViewTemplates = dict[tuple[object, ...], tuple[tuple[WorldMember, ...], rpb.WorldView]]


def world_view_pb(view: WorldView, templates: ViewTemplates | None = None) -> rpb.WorldView:
    """A world view as a message.

    Args:
        templates: Shared across the calls for the views of one admitted
            world: views with the very same ``members`` tuple copy one encoded
            template (a copy in C) instead of encoding every member again, so
            admitting a world of n costs O(n) Python work, not O(n^2).
    """
    key = (id(view.members), view.job_id, view.generation, view.size, view.is_homogeneous,
           view.store_prefix, view.host_update_epoch)
    held = templates.get(key) if templates is not None else None
    if held is not None and held[0] is view.members:
        template = held[1]
    else:
        template = rpb.WorldView(
            job_id=view.job_id,
            generation=view.generation,
            size=view.size,
            is_homogeneous=view.is_homogeneous,
            members=[_member_pb(m) for m in view.members],
            store_prefix=view.store_prefix,
            host_update_epoch=view.host_update_epoch,
        )
        if templates is not None:
            # Holding the tuple keeps its id from being reused while the entry lives.
            templates[key] = (view.members, template)
    out = rpb.WorldView()
    out.CopyFrom(template)
    out.rank = view.rank
    out.local_rank = view.local_rank
    out.local_size = view.local_size
    out.cross_rank = view.cross_rank
    out.cross_size = view.cross_size
    return out


def join_response_pb(view: rpb.WorldView) -> rpb.JoinResponse:
    """The answer of Join and GetWorld around an encoded view."""
    return rpb.JoinResponse(world=view)


def heartbeat_pb(reply: HeartbeatReply) -> rpb.HeartbeatResponse:
    """A heartbeat's reply as a message."""
    return rpb.HeartbeatResponse(
        generation=reply.generation,
        job_state=reply.job_state,  # type: ignore[arg-type]
        lease_ms=reply.lease_ms,
        failure=reply.failure,
        host_update_epoch=reply.host_update_epoch,
        removals_only=reply.removals_only,
        interval_ms=reply.interval_ms,
    )


def list_events_response_pb(events: Iterable[JobEvent]) -> rpb.ListEventsResponse:
    """A job's event log as ListEvents' answer, in the same order."""
    return rpb.ListEventsResponse(events=[
        rpb.JobEvent(
            unix_ms=e.unix_ms,
            kind=e.kind,
            generation=e.generation,
            rank=e.rank,
            host=e.host,
            pid=e.pid,
            message=e.message,
        )
        for e in events
    ])


# ---- outgoing: negotiation --------------------------------------------------------------


def event_pb(event: Event) -> npb.Event:
    """One event as a message."""
    return npb.Event(
        type=event.type,  # type: ignore[arg-type]
        generation=event.generation,
        rank=event.rank,
        host=event.host,
        pid=event.pid,
        message=event.message,
        tensor_names=event.tensor_names,
        missing_ranks=event.missing_ranks,
        unix_ms=event.unix_ms,
        ranks=event.ranks,
    )


def coordinator_message_pb(message: CoordinatorMessage) -> npb.CoordinatorMessage:
    """One stream message as a message: its response list, event or heartbeat answer."""
    if message.responses is not None:
        return npb.CoordinatorMessage(
            responses=npb.ResponseList(
                responses=[response_pb(r) for r in message.responses.responses],
                number=message.responses.number,
            )
        )
    if message.event is not None:
        return npb.CoordinatorMessage(event=event_pb(message.event))
    if message.heartbeat is not None:
        answer = message.heartbeat
        return npb.CoordinatorMessage(
            heartbeat=npb.StreamHeartbeatAnswer(
                sequence=answer.sequence, state=heartbeat_pb(answer.state)
            )
        )
    return npb.CoordinatorMessage()
