"""Effects: what the coordinator must do after a transition, and helpers that make them."""

from __future__ import annotations

from dataclasses import dataclass

from hora_negotiation import SetCallKind

from ..errors import CoordinatorError
from ..messages import CoordinatorMessage, Event, EventType, Response, ResponseList
from .job import Job, Member, MemberState
from .views import WorldView

__all__ = [
    "Admit",
    "Answer",
    "Effect",
    "Log",
    "NewGeneration",
    "Reject",
    "Send",
    "event_message",
    "responses_message",
    "send_by_rank",
]


@dataclass(frozen=True)
class NewGeneration:
    """A generation formed: open an outbox for each of these workers."""

    generation: int
    worker_ids: tuple[str, ...]


@dataclass(frozen=True)
class Admit:
    """Answer this worker's pending Join with its world view."""

    worker_id: str
    view: WorldView


@dataclass(frozen=True)
class Reject:
    """Answer this worker's pending Join with an error."""

    worker_id: str
    error: CoordinatorError


@dataclass(frozen=True)
class Answer:
    """Answer these workers' waiting process set calls of ``kind``.

    With success when ``error`` is None, else every one of them with ``error``.
    """

    worker_ids: tuple[str, ...]
    kind: SetCallKind
    error: CoordinatorError | None = None


@dataclass(frozen=True)
class Send:
    """Queue one message on the negotiation stream of each of these workers."""

    worker_ids: tuple[str, ...]
    message: CoordinatorMessage


@dataclass(frozen=True)
class Log:
    """Write one log line."""

    level: int
    message: str


Effect = NewGeneration | Admit | Reject | Answer | Send | Log


def event_message(
    job: Job,
    kind: EventType,
    now: float,
    member: Member | None,
    message: str,
    tensor_names: tuple[str, ...] = (),
    missing_ranks: tuple[int, ...] = (),
) -> CoordinatorMessage:
    """An event of the current generation, about ``member`` if one is given."""
    rank, host, pid = (member.rank, member.host, member.pid) if member is not None else (-1, "", 0)
    return CoordinatorMessage(
        event=Event(
            type=kind,
            generation=job.generation,
            rank=rank,
            host=host,
            pid=pid,
            message=message,
            tensor_names=tensor_names,
            missing_ranks=missing_ranks,
            unix_ms=int(now * 1000),
        )
    )


def responses_message(responses: list[Response]) -> CoordinatorMessage:
    """A response list, in this order, as one stream message."""
    return CoordinatorMessage(responses=ResponseList(tuple(responses)))


def send_by_rank(job: Job, responses_by_rank: dict[int, list[Response]]) -> list[Effect]:
    """One Send per ACTIVE recipient rank; counts the responses as errors."""
    effects: list[Effect] = []
    for rank, responses in responses_by_rank.items():
        recipient = job.members[rank]
        if recipient.state is MemberState.ACTIVE:
            job.errors += len(responses)
            effects.append(Send((recipient.worker_id,), responses_message(responses)))
    return effects
