"""A member's negotiation stream: opening it, its requests."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from ..errors import JobFailedError, PreconditionError, StaleGenerationError, shown_id
from ..messages import (
    CoordinatorMessage,
    ErrorKind,
    ReceivedLists,
    Response,
    ResponseType,
    TensorRequest,
)
from .effects import Effect, Log, Send, responses_message
from .job import Job, JobPhase, Member, MemberState

__all__ = [
    "active_member",
    "handle_requests",
    "open_stream",
    "redeliver",
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
    deliveries = job.table.deliveries
    if deliveries.watching:  # only after a re-sent list: off the usual hot path
        requests = [r for r in requests if not deliveries.stale(member.rank, r)]
    outcome = job.table.submit(member.rank, requests, now)
    job.negotiated_tensors += outcome.negotiated
    job.errors += outcome.errors
    effects: list[Effect] = []
    if outcome.direct:
        effects.append(Send((worker_id,), responses_message(outcome.direct)))
    members = job.members
    for pset, response_list in outcome.broadcasts:
        ranks = [r for r in pset.ranks if members[r].state is MemberState.ACTIVE]
        numbered = deliveries.number(pset.id, ranks, response_list)
        recipients = tuple(members[r].worker_id for r in ranks)
        effects.append(Send(recipients, CoordinatorMessage(responses=numbered)))
    for rank, responses in outcome.targeted.items():
        if members[rank].state is MemberState.ACTIVE:
            effects.append(Send((members[rank].worker_id,), responses_message(responses)))
    return effects


def redeliver(job: Job, member: Member, received: Iterable[ReceivedLists]) -> list[Effect]:
    """A member opened its stream (again) and reported the lists it received:
    re-sends, in order, every numbered list some reporting member lacks
    (:mod:`hora_negotiation.deliveries`), and withdraws from the table the
    requests those lists answer on that member (sent again before they came)."""
    table = job.table
    member_of = [s.id for s in table.process_sets.values() if member.rank in s.members]
    effects: list[Effect] = []
    for redelivery in table.deliveries.report(member.rank, member_of, received):
        target = job.members[redelivery.rank]
        if target.state is not MemberState.ACTIVE:
            continue
        if redelivery.lost:
            effects.append(Log(logging.WARNING, (
                f"job '{job.job_id}' generation {job.generation}: {target.describe()} missed "
                f"response list(s) {list(redelivery.lost)}, which no member holds any more; "
                f"its pending collectives may stall")))
            continue
        for numbered in redelivery.lists:
            for response in numbered.responses:
                for name in response.tensor_names:
                    pending = table.pending.get((response.process_set_id, name))
                    if pending is not None and pending.submissions.pop(
                            target.rank, None) is not None:
                        if not pending.submissions:
                            del table.pending[(response.process_set_id, name)]
            effects.append(Send((target.worker_id,), CoordinatorMessage(responses=numbered)))
        effects.append(Log(logging.WARNING, (
            f"job '{job.job_id}' generation {job.generation}: redelivered response list(s) "
            f"{[n.number for n in redelivery.lists]} to {target.describe()}, which had missed "
            f"them (the coordinator went away mid-delivery)")))
    return effects
