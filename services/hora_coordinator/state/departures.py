"""Members going away: leaving on purpose, or lost; what that means for the job."""

from __future__ import annotations

import enum
import logging

from ..errors import PreconditionError
from ..messages import EventType
from .effects import Effect, Log, Reject, Send, event_message, send_by_rank
from .elastic import end_generation, lose_before_rejoining
from .generations import fail_job, maybe_form
from .job import Job, JobPhase, Member, MemberState, Round, kept_text, record
from .process_sets import abandon_set_calls
from .rendezvous import cancel_join

__all__ = [
    "LossDecision",
    "decide_after_loss",
    "leave",
    "leave_between",
    "lose",
    "stream_closed",
]


def leave(job: Job, worker_id: str, reason: str, now: float, rejoin: bool = False) -> list[Effect]:
    """A worker leaves on purpose (idempotent).

    Pending tensors the leaver never submitted fail on the ranks that did, and
    so do the process set calls waiting for every rank; the others get
    MEMBER_LEFT. When the last member leaves the job is FINISHED and
    a complete waiting round forms the next generation.

    With ``rejoin`` (elastic jobs only; ignored otherwise) the member leaves
    this generation only: the generation is over, and the next round expects
    the leaver (and every other member still alive) to Join again.

    The reason is kept cut to :data:`~.job.TEXT_LIMIT` characters.
    """
    reason = kept_text(reason)
    rejoin = rejoin and job.elastic is not None
    rnd = job.round
    if rnd is not None and worker_id in rnd.joiners:
        effects: list[Effect] = cancel_join(job, worker_id, now)
        effects.append(
            Reject(
                worker_id,
                PreconditionError(
                    f"worker {worker_id} left job '{job.job_id}' before the world gathered"
                ),
            )
        )
        if worker_id in rnd.expected and not rejoin:
            effects.extend(leave_between(job, rnd, job.by_worker[worker_id], reason, False, now))
        return effects
    member = job.by_worker.get(worker_id)
    if member is None:
        return []
    if job.phase is JobPhase.GATHERING and rnd is not None and worker_id in rnd.expected:
        return leave_between(job, rnd, member, reason, rejoin, now)
    if member.state is not MemberState.ACTIVE:
        return []
    rejoin = rejoin and job.phase is JobPhase.RUNNING
    member.state = MemberState.LEFT
    member.rejoin = rejoin
    member.cause = reason or ("reset" if rejoin else "left")
    record(job, now, "reset" if rejoin else "left", member.cause, member)
    what = "left for an elastic reset" if rejoin else "left"
    effects = [
        Log(
            logging.INFO,
            f"job '{job.job_id}' generation {job.generation}: "
            f"{member.describe()} {what} ({member.cause})",
        )
    ]
    if job.phase is not JobPhase.RUNNING:
        return effects
    gone = f"{member.describe()} " + ("left for an elastic reset" if rejoin else "has shut down")
    failed = job.table.depart(member.rank, gone)
    effects.extend(send_by_rank(job, failed))
    effects.extend(abandon_set_calls(job, gone))
    others = job.active_worker_ids()
    if others:
        effects.append(
            Send(others, event_message(job, EventType.MEMBER_LEFT, now, member, member.cause))
        )
    if rejoin:
        effects.extend(end_generation(job, now, f"{member.describe()} left to re-join"))
        return effects
    if others:
        return effects
    job.phase = JobPhase.FINISHED
    job.table.clear()
    record(job, now, "finished", f"every member of generation {job.generation} left")
    effects.append(Log(logging.INFO, f"job '{job.job_id}': generation {job.generation} finished"))
    effects.extend(maybe_form(job, now))
    return effects


def leave_between(
    job: Job, rnd: Round, member: Member, reason: str, rejoin: bool, now: float
) -> list[Effect]:
    """Leave of a member of an ended elastic generation that the next round expects."""
    effects: list[Effect] = []
    if rejoin:
        member.last_heartbeat = max(member.last_heartbeat, now)  # a fresh lease to re-join
        if member.state is MemberState.ACTIVE:
            member.state, member.rejoin, member.cause = MemberState.LEFT, True, reason or "reset"
            record(job, now, "reset", member.cause, member)
        return effects
    member.state, member.rejoin, member.cause = MemberState.LEFT, False, reason or "left"
    rnd.expected.discard(member.worker_id)
    record(job, now, "left", member.cause, member)
    effects.append(
        Log(
            logging.INFO,
            f"job '{job.job_id}': {member.describe()} of ended generation {job.generation} "
            f"left ({member.cause}); the next round no longer expects it",
        )
    )
    if not rnd.expected and not rnd.joiners:
        job.phase = JobPhase.FINISHED
        job.round = None
        record(job, now, "finished", "every member left")
        effects.append(Log(logging.INFO, f"job '{job.job_id}': every member left; finished"))
        return effects
    effects.extend(maybe_form(job, now))
    return effects


def stream_closed(job: Job, worker_id: str, generation: int, now: float) -> list[Effect]:
    """A member's negotiation stream ended; without a prior Leave the member is lost.

    Also just after its generation ended, while the elastic round waits for the
    survivors to re-join: a survivor leaves that generation (Leave with rejoin)
    before it closes its stream, so a member still active whose stream closes
    has died. It is lost at once, not a lease later; that happens when a peer's
    data plane noticed a killed worker before the coordinator did, and the
    survivors' resets ended the generation first.
    """
    if generation != job.generation:
        return []
    member = job.by_worker.get(worker_id)
    if member is None or member.state is not MemberState.ACTIVE:
        return []
    if job.phase is JobPhase.RUNNING:
        return lose(job, member, "stream closed", now)
    rnd = job.round
    if (job.phase is not JobPhase.GATHERING or rnd is None or not rnd.follows_generation
            or worker_id not in rnd.expected or worker_id in rnd.joiners):
        return []
    effects = lose_before_rejoining(job, rnd, member, "stream closed", now)
    effects.extend(maybe_form(job, now))
    return effects


class LossDecision(enum.Enum):
    """What a job does when it loses a member."""

    FAIL_JOB = "fail job"
    NEW_GENERATION = "new generation"


def decide_after_loss(job: Job, member: Member) -> LossDecision:
    """The one place that decides what losing a member means for the job.

    Non-elastic jobs fail; elastic jobs end the generation and open the next
    round (which fails the job later if it cannot gather min_size workers).
    """
    return LossDecision.FAIL_JOB if job.elastic is None else LossDecision.NEW_GENERATION


def lose(job: Job, member: Member, cause: str, now: float) -> list[Effect]:
    """``member`` is LOST: tell the others, then fail the job or end the generation."""
    member.state = MemberState.LOST
    member.cause = cause
    decision = decide_after_loss(job, member)
    failure = f"{member.describe()} was lost: {cause}"
    record(job, now, "lost", cause, member)
    level = logging.ERROR if decision is LossDecision.FAIL_JOB else logging.WARNING
    effects: list[Effect] = [
        Log(level, f"job '{job.job_id}' generation {job.generation}: {failure}")
    ]
    others = job.active_worker_ids()
    if others:
        effects.append(Send(others, event_message(job, EventType.MEMBER_LOST, now, member, cause)))
    if decision is LossDecision.NEW_GENERATION:
        effects.extend(end_generation(job, now, failure))
    else:
        effects.extend(fail_job(job, failure, now))
    return effects
