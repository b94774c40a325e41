"""A member's negotiation stream: opening it, its requests."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import JobFailedError, PreconditionError, StaleGenerationError, shown_id
from ..messages import CoordinatorMessage, ErrorKind, Response, ResponseType, TensorRequest
from .effects import Effect, Send, responses_message
from .job import Job, JobPhase, Member, MemberState

__all__ = [
    "active_member",
    "handle_requests",
    "open_stream",
]


def open_stream(job: Job, worker_id: str, generation: int, now: float) -> Member:
    """Checks that a worker may open its negotiation stream for ``generation``.

    Raises:
        JobFailedError: the job failed.
        StaleGenerationError: ``generation`` is not the running one.
        PreconditionError: the worker is not an ACTIVE member.
    """
    member = active_member(job, worker_id, generation)
    member.last_heartbeat = now
    return member


def active_member(job: Job, worker_id: str, generation: int) -> Member:
    """The ACTIVE member ``worker_id`` of running generation ``generation``, or raises.

    Raises:
        JobFailedError: the job failed.
        StaleGenerationError: ``generation`` is not the running one.
        PreconditionError: the worker is not an ACTIVE member.
    """
    if job.phase is JobPhase.FAILED:
        raise JobFailedError(f"job '{job.job_id}' has failed: {job.failure}")
    if generation != job.generation or job.phase is not JobPhase.RUNNING:
        raise StaleGenerationError(
            f"generation {generation} of job '{job.job_id}' is not running (current generation "
            f"{job.generation}, state {job.phase.value})"
        )
    member = job.by_worker.get(worker_id)
    if member is None or member.state is not MemberState.ACTIVE:
        raise PreconditionError(
            f"worker {shown_id(worker_id)} is not an active member of job "
            f"'{job.job_id}' generation {generation}"
        )
    return member


def handle_requests(
    job: Job, worker_id: str, generation: int, requests: Sequence[TensorRequest], now: float
) -> list[Effect]:
    """The requests of one RequestList from a member's stream: record, answer what is ready.

    This is the hot path: it costs O(tensors in the message + ranks answered),
    times the number of joined ranks while some have joined; a join request
    itself costs O(pending tensors).
    """
    job.negotiation_messages += 1
    member = job.by_worker.get(worker_id)
    if (
        job.phase is not JobPhase.RUNNING
        or generation != job.generation
        or member is None
        or member.state is not MemberState.ACTIVE
    ):
        if not requests:
            return []
        if job.phase is JobPhase.FAILED:
            why = f"job '{job.job_id}' has failed: {job.failure}"
        else:
            why = f"generation {generation} of job '{job.job_id}' is over"
        responses = [
            Response(
                type=ResponseType.ERROR,
                tensor_names=(r.name,),
                process_set_id=r.process_set_id,
                error_message=f"tensor '{r.name}' cannot run: {why}",
                error_kind=ErrorKind.RANK_GONE,
            )
            for r in requests
        ]
        job.errors += len(responses)
        return [Send((worker_id,), responses_message(responses))]
    member.last_heartbeat = now
    outcome = job.table.submit(member.rank, requests, now)
    job.negotiated_tensors += outcome.negotiated
    job.errors += outcome.errors
    effects: list[Effect] = []
    if outcome.direct:
        effects.append(Send((worker_id,), responses_message(outcome.direct)))
    members = job.members
    for pset, response_list in outcome.broadcasts:
        recipients = tuple(
            members[r].worker_id for r in pset.ranks if members[r].state is MemberState.ACTIVE
        )
        effects.append(Send(recipients, CoordinatorMessage(responses=response_list)))
    for rank, responses in outcome.targeted.items():
        if members[rank].state is MemberState.ACTIVE:
            effects.append(Send((members[rank].worker_id,), responses_message(responses)))
    return effects
