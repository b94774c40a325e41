"""Effects: what the coordinator must do after a transition, and helpers that make them."""

from __future__ import annotations

from dataclasses import dataclass

from hora_proto.v1 import negotiation_pb2 as npb
from hora_proto.v1 import rendezvous_pb2 as rpb

from ..errors import CoordinatorError
from .job import Job, Member, MemberState

__all__ = [
    "Admit",
    "Effect",
    "Log",
    "NewGeneration",
    "Reject",
    "Send",
    "event_message",
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
    view: rpb.WorldView


@dataclass(frozen=True)
class Reject:
    """Answer this worker's pending Join with an error."""

    worker_id: str
    error: CoordinatorError


@dataclass(frozen=True)
class Send:
    """Queue one message on the negotiation stream of each of these workers."""

    worker_ids: tuple[str, ...]
    message: npb.CoordinatorMessage


@dataclass(frozen=True)
class Log:
    """Write one log line."""

    level: int
    message: str


Effect = NewGeneration | Admit | Reject | Send | Log


def event_message(
    job: Job, kind: int, now: float, member: Member | None, message: str
) -> npb.CoordinatorMessage:
    event = npb.Event(
        type=kind, generation=job.generation, rank=-1, message=message, unix_ms=int(now * 1000)
    )
    if member is not None:
        event.rank, event.host, event.pid = member.rank, member.host, member.pid
    return npb.CoordinatorMessage(event=event)


def send_by_rank(job: Job, responses_by_rank: dict[int, list[npb.Response]]) -> list[Effect]:
    """One Send per ACTIVE recipient rank; counts the responses as errors."""
    effects: list[Effect] = []
    for rank, responses in responses_by_rank.items():
        recipient = job.members[rank]
        if recipient.state is MemberState.ACTIVE:
            job.errors += len(responses)
            effects.append(
                Send(
                    (recipient.worker_id,),
                    npb.CoordinatorMessage(responses=npb.ResponseList(responses=responses)),
                )
            )
    return effects
