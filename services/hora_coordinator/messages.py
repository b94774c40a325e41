"""What the coordinator hears and says, as plain data: no protobuf in here.

Each class is the twin of a ``hora.v1`` message (``proto/hora/v1/*.proto``)
with the same field names, so the .proto's documentation of a field holds for
its twin, and each enum has the .proto's member names (without the prefix)
and numbers. The transitions in :mod:`.state` and :mod:`hora_negotiation` take
and return these; :mod:`.wire` is the one place that converts between them and
the generated stubs. The world views' twins live beside the state they show,
in :mod:`.state.views`.

The negotiation's own messages (the collective enums, tensor requests,
responses) are declared in :mod:`hora_negotiation.messages`, which a world
of one uses without this service, and re-exported here.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from hora_negotiation.messages import (
    ErrorKind,
    OpType,
    PlainTensorRequest,
    ReceivedLists,
    ReduceOp,
    Response,
    ResponseList,
    ResponseType,
    TensorRequest,
)

__all__ = [
    "AddProcessSetRequest",
    "CoordinatorMessage",
    "ErrorKind",
    "HeartbeatReply",
    "Event",
    "EventType",
    "JobState",
    "JoinRequest",
    "OpType",
    "PlainTensorRequest",
    "ReattachRequest",
    "ReceivedLists",
    "ReduceOp",
    "RemoveProcessSetRequest",
    "StreamHeartbeatAnswer",
    "ReportedMember",
    "Response",
    "ResponseList",
    "ResponseType",
    "TensorRequest",
]


class EventType(enum.IntEnum):
    """What an event on a negotiation stream reports (``hora.v1.EventType``)."""

    UNSPECIFIED = 0
    MEMBER_LOST = 1
    MEMBER_LEFT = 2
    JOB_FAILED = 3
    STALL_WARNING = 4


class JobState(enum.IntEnum):
    """A job's state as a heartbeat reports it (``hora.v1.JobState``)."""

    UNSPECIFIED = 0
    GATHERING = 1
    RUNNING = 2
    FINISHED = 3
    FAILED = 4


@dataclass(frozen=True)
class ReportedMember:
    """One member of a generation as a re-attaching worker knows it."""

    rank: int
    worker_id: str
    host: str
    pid: int
    data_plane_address: str


@dataclass(frozen=True)
class JoinRequest:
    """A worker asks to join the next generation (``hora.v1.JoinRequest``).

    Durations are in milliseconds and sizes in bytes, as on the wire; 0 means
    "not set" wherever the .proto says so.
    """

    job_id: str = ""
    worker_id: str = ""
    host: str = ""
    pid: int = 0
    expected_size: int = 0
    rank_hint: int = 0
    data_plane_address: str = ""
    fusion_threshold_bytes: int = 0
    stall_warning_ms: int = 0
    stall_shutdown_ms: int = 0
    min_size: int = 0
    max_size: int = 0
    elastic_timeout_ms: int = 0
    # The job-level options by field name as the worker sent them (see
    # hora_proto.options); the fields above are their typed reading.
    job_options: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ReattachRequest:
    """A member of a running generation that lost the coordinator reports in
    (``hora.v1.ReattachRequest``).

    Attributes:
        join: Who the worker is and the job's settings, as it joined.
        generation: The generation it belongs to.
        rank: Its rank there.
        members: Every member of that generation, by rank.
        process_sets: The sets registered in it, by id (the global set excluded).
        host_update_epoch: The newest host-change epoch the worker has seen.
    """

    join: JoinRequest
    generation: int
    rank: int
    members: tuple[ReportedMember, ...]
    process_sets: dict[int, tuple[int, ...]] = field(default_factory=dict)
    host_update_epoch: int = 0


@dataclass(frozen=True)
class AddProcessSetRequest:
    """One rank's call of a collective AddProcessSet (``hora.v1.AddProcessSetRequest``)."""

    job_id: str = ""
    worker_id: str = ""
    generation: int = 0
    process_set_id: int = 0
    ranks: tuple[int, ...] = ()
    invalid: str = ""


@dataclass(frozen=True)
class RemoveProcessSetRequest:
    """One rank's call of a collective RemoveProcessSet (``hora.v1.RemoveProcessSetRequest``).

    ``process_set_id`` is -1 when the caller never added the set.
    """

    job_id: str = ""
    worker_id: str = ""
    generation: int = 0
    process_set_id: int = 0
    invalid: str = ""


@dataclass(frozen=True)
class Event:
    """Something members should hear of (``hora.v1.Event``).

    ``rank`` is -1 and ``pid`` 0 where the event concerns no single member.
    """

    type: EventType
    generation: int = 0
    rank: int = -1
    host: str = ""
    pid: int = 0
    message: str = ""
    tensor_names: tuple[str, ...] = ()
    missing_ranks: tuple[int, ...] = ()
    unix_ms: int = 0
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class HeartbeatReply:
    """A renewed lease and the job's state (``hora.v1.HeartbeatResponse``)."""

    generation: int
    job_state: JobState
    lease_ms: int
    failure: str
    host_update_epoch: int
    removals_only: bool
    interval_ms: int = 0

@dataclass(frozen=True)
class StreamHeartbeatAnswer:
    """The answer to a heartbeat on a negotiation stream (``hora.v1.StreamHeartbeatAnswer``)."""

    sequence: int
    state: HeartbeatReply


@dataclass(frozen=True)
class CoordinatorMessage:
    """One message on a member's negotiation stream (``hora.v1.CoordinatorMessage``).

    Exactly one of ``responses``, ``event`` and ``heartbeat`` is set, as in the
    .proto's oneof.
    """

    responses: ResponseList | None = None
    event: Event | None = None
    heartbeat: StreamHeartbeatAnswer | None = None
