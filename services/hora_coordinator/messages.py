"""What the coordinator hears and says, as plain data: no protobuf in here.

Each class is the twin of a ``hora.v1`` message (``proto/hora/v1/*.proto``)
with the same field names, so the .proto's documentation of a field holds for
its twin, and each enum has the .proto's member names (without the prefix)
and numbers. The transitions in :mod:`.state` and :mod:`.negotiation` take and
return these; :mod:`.wire` is the one place that converts between them and the
generated stubs. The twins of the rendezvous answers (world views, heartbeat
replies) live beside the state they show, in :mod:`.state.views`.

One exception, on purpose: the negotiation table reads tensor requests
through the :class:`TensorRequest` protocol, which the ``hora.v1.TensorRequest``
message satisfies as it is. Copying every request of every step into a
dataclass would about double the cost of the hot path (about 2.8 us per
request, against about 2.6 us to negotiate it), and the table only reads
them. :class:`PlainTensorRequest` satisfies the protocol too, for callers
without protobuf.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the heartbeat answers' twins live in .state.views, which imports this
    from .state.views import StreamHeartbeatAnswer

__all__ = [
    "AddProcessSetRequest",
    "CoordinatorMessage",
    "ErrorKind",
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
    "ReportedMember",
    "Response",
    "ResponseList",
    "ResponseType",
    "TensorRequest",
]


class OpType(enum.IntEnum):
    """The collective a tensor request asks for (``hora.v1.OpType``)."""

    UNSPECIFIED = 0
    ALLREDUCE = 1
    ALLGATHER = 2
    BROADCAST = 3
    ALLTOALL = 4
    REDUCESCATTER = 5
    BARRIER = 6
    JOIN = 7


class ReduceOp(enum.IntEnum):
    """How an allreduce combines values (``hora.v1.ReduceOp``)."""

    UNSPECIFIED = 0
    AVERAGE = 1
    SUM = 2
    ADASUM = 3
    MIN = 4
    MAX = 5
    PRODUCT = 6


class ResponseType(enum.IntEnum):
    """What a response tells the ranks to do (``hora.v1.ResponseType``).

    The six collectives share their numbers with :class:`OpType`.
    """

    UNSPECIFIED = 0
    ALLREDUCE = 1
    ALLGATHER = 2
    BROADCAST = 3
    ALLTOALL = 4
    REDUCESCATTER = 5
    BARRIER = 6
    ERROR = 7
    JOIN = 8


class ErrorKind(enum.IntEnum):
    """Why an error response failed its tensors (``hora.v1.ErrorKind``)."""

    UNSPECIFIED = 0
    MISMATCH = 1
    RANK_GONE = 2
    INVALID = 3


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


class TensorRequest(Protocol):
    """What the negotiation table reads of one rank's request for one tensor.

    ``hora.v1.TensorRequest`` satisfies it as it is (see the module docstring).
    """

    @property
    def name(self) -> str: ...
    @property
    def op_type(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def device(self) -> str: ...
    @property
    def reduce_op(self) -> int: ...
    @property
    def root_rank(self) -> int: ...
    @property
    def prescale_factor(self) -> float: ...
    @property
    def postscale_factor(self) -> float: ...
    @property
    def process_set_id(self) -> int: ...
    @property
    def splits(self) -> Sequence[int]: ...
    @property
    def group_id(self) -> int: ...
    @property
    def group_size(self) -> int: ...
    @property
    def invalid(self) -> str: ...
    @property
    def resent(self) -> bool: ...
    @property
    def received_list(self) -> int: ...


@dataclass(frozen=True)
class PlainTensorRequest:
    """A :class:`TensorRequest` as a plain dataclass (``hora.v1.TensorRequest``'s fields)."""

    name: str = ""
    op_type: int = OpType.UNSPECIFIED
    dtype: str = ""
    shape: tuple[int, ...] = ()
    device: str = ""
    reduce_op: int = ReduceOp.UNSPECIFIED
    root_rank: int = 0
    prescale_factor: float = 0.0
    postscale_factor: float = 0.0
    process_set_id: int = 0
    splits: tuple[int, ...] = ()
    group_id: int = 0
    group_size: int = 0
    invalid: str = ""
    resent: bool = False
    received_list: int = 0


@dataclass(frozen=True)
class Response:
    """What the ranks of a process set run next, or why they cannot (``hora.v1.Response``).

    Attributes:
        type: The collective, ERROR or JOIN.
        tensor_names: The tensors it covers, in fusion order.
        process_set_id: The set it runs on.
        first_dims: Allgather only: each set rank's first dimension, in set order.
        splits: Alltoall only: the sender-major split matrix.
        error_message: ERROR only: the text every recipient raises.
        error_kind: ERROR only: why.
        join_fill: Allreduces that some joined rank never submitted: the
            request of a rank that did, per name, in name order.
        last_joined_rank: JOIN only: the rank that joined last.
    """

    type: ResponseType
    tensor_names: tuple[str, ...] = ()
    process_set_id: int = 0
    first_dims: tuple[int, ...] = ()
    splits: tuple[int, ...] = ()
    error_message: str = ""
    error_kind: ErrorKind = ErrorKind.UNSPECIFIED
    join_fill: tuple[TensorRequest, ...] = ()
    last_joined_rank: int = 0


@dataclass(frozen=True)
class ResponseList:
    """Responses every recipient runs in this order (``hora.v1.ResponseList``).

    ``number`` counts the lists sent to every rank of one process set, per set
    and generation, from 1; 0 on a list for one rank only.
    """

    responses: tuple[Response, ...] = ()
    number: int = 0


@dataclass(frozen=True)
class ReceivedLists:
    """What a worker opening its stream again has received of one process set
    (``hora.v1.ReceivedLists``): the last list's number and the newest lists."""

    process_set_id: int
    last_number: int
    recent: tuple[ResponseList, ...] = ()


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
class CoordinatorMessage:
    """One message on a member's negotiation stream (``hora.v1.CoordinatorMessage``).

    Exactly one of ``responses``, ``event`` and ``heartbeat`` is set, as in the
    .proto's oneof.
    """

    responses: ResponseList | None = None
    event: Event | None = None
    heartbeat: StreamHeartbeatAnswer | None = None
