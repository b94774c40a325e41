"""Liveness: heartbeats, and the periodic check of leases, stalls and round deadlines."""

from __future__ import annotations

import logging

from hora_negotiation import PendingTensor, describe_waits, format_ranks

from ..messages import EventType
from .departures import lose
from .effects import Effect, Log, Send, event_message
from .elastic import check_newcomers, check_round
from .generations import fail_job
from .job import Job, JobPhase, MemberState
from .leases import expired
from .process_sets import overdue_set_calls
from .telemetry import RankTelemetry
from .views import JOB_STATE, HeartbeatReply

__all__ = [
    "check",
    "forgive_stall",
    "heartbeat",
]


def heartbeat(
    job: Job,
    worker_id: str,
    now: float,
    lease_s: float,
    interval_s: float | None = None,
    telemetry: RankTelemetry | None = None,
) -> HeartbeatReply:
    """Renews a member's lease and reports the job's generation and state.

    Renews ACTIVE members, and members of an ended elastic generation that the
    next round still expects (they are between Leave(rejoin) and Join). The
    reply grants ``lease_s`` and asks for a heartbeat every ``interval_s``
    (by default a quarter of the lease); the member is judged on that lease
    until its next heartbeat, even if the job's lease shrinks meanwhile.
    An ACTIVE member's ``telemetry`` replaces what it reported before.
    """
    member = job.by_worker.get(worker_id)
    if member is not None and (
        member.state is MemberState.ACTIVE
        or (job.round is not None and worker_id in job.round.expected)
    ):
        member.last_heartbeat = now
        member.lease_s = lease_s
        if telemetry is not None and member.state is MemberState.ACTIVE:
            job.telemetry[worker_id] = telemetry
    if interval_s is None:
        interval_s = lease_s / 4
    return HeartbeatReply(
        generation=job.generation,
        job_state=JOB_STATE[job.phase],
        lease_ms=int(lease_s * 1000),
        failure=job.failure,
        host_update_epoch=job.host_update_epoch,
        removals_only=job.removals_only,
        interval_ms=max(1, int(interval_s * 1000)),
    )



def forgive_stall(job: Job, stalled_s: float) -> None:
    """The coordinator itself did not run for ``stalled_s`` seconds (a long GC, a
    slow request, SIGSTOP): that time must not count against the workers.

    Heartbeats and calls sent meanwhile are still queued, unread; so every
    lease, every pending tensor's stall clock (and its warning's), every
    waiting process set call's deadline and an elastic round's deadline move
    on by ``stalled_s``. A member that was really silent is lost all the same,
    one lease after the coordinator resumed.
    """
    if stalled_s <= 0:
        return
    for member in job.members:
        member.last_heartbeat += stalled_s
    for tensor in job.table.pending.values():
        tensor.first_seen += stalled_s
        if tensor.last_warned is not None:
            tensor.last_warned += stalled_s
    job.table.set_calls.shift(stalled_s)
    if job.round is not None:
        job.round.opened_at += stalled_s


def check(job: Job, now: float, lease_s: float) -> list[Effect]:
    """The periodic check: expired leases, overdue process set calls, then stalled
    tensors; elastic rounds' deadlines."""
    if job.phase is not JobPhase.RUNNING and job.elastic is not None and job.round is not None:
        return check_round(job, job.elastic, job.round, now, lease_s)
    if job.phase is not JobPhase.RUNNING:
        return []
    effects: list[Effect] = []
    if job.elastic is not None:
        effects.extend(check_newcomers(job, now, lease_s))
    for member in job.members:
        if member.state is MemberState.ACTIVE and expired(member, now, lease_s):
            silent = now - member.last_heartbeat
            effects.extend(
                lose(job, member, f"lease expired (no heartbeat for {silent:.1f} s)", now)
            )
            if job.phase is not JobPhase.RUNNING:
                return effects
    effects.extend(overdue_set_calls(job, now))
    config = job.config
    if config is None or (config.stall_warning_s <= 0 and config.stall_shutdown_s <= 0):
        return effects
    warn_s, shutdown_s = config.stall_warning_s, config.stall_shutdown_s
    for tensor in list(job.table.pending.values()):
        waited = now - tensor.first_seen
        if shutdown_s > 0 and waited > shutdown_s:
            missing_ranks = job.table.missing_ranks(tensor)
            failure = (
                f"tensor '{tensor.name}' stalled for {waited:.1f} s; missing ranks: "
                f"{format_ranks(missing_ranks)} (stall shutdown time {shutdown_s:g} s)"
                f"{_waits(job, tensor, missing_ranks)}"
            )
            effects.append(Log(logging.ERROR, f"job '{job.job_id}': {failure}"))
            effects.extend(fail_job(job, failure, now))
            return effects
        if warn_s <= 0 or waited <= warn_s:
            continue
        if tensor.last_warned is not None and now - tensor.last_warned < warn_s:
            continue
        tensor.last_warned = now
        missing_ranks = job.table.missing_ranks(tensor)
        text = (
            f"tensor '{tensor.name}' has waited {waited:.1f} s; missing ranks: "
            f"{format_ranks(missing_ranks)}{_waits(job, tensor, missing_ranks)}"
        )
        effects.append(
            Log(logging.WARNING, f"job '{job.job_id}' generation {job.generation}: {text}")
        )
        message = event_message(
            job,
            EventType.STALL_WARNING,
            now,
            None,
            text,
            tensor_names=(tensor.name,),
            missing_ranks=tuple(missing_ranks),
        )
        submitters = tuple(
            job.members[r].worker_id
            for r in sorted(tensor.submissions)
            if job.members[r].state is MemberState.ACTIVE
        )
        effects.append(Send(submitters, message))
    return effects


def _waits(job: Job, tensor: PendingTensor, missing_ranks: list[int]) -> str:
    """``"; rank 1 is waiting in allgather 'b'"``: what the missing ranks submitted
    and wait in, when the table knows (else nothing)."""
    waits = describe_waits(job.table.pending.values(), tensor, missing_ranks)
    return f"; {waits}" if waits else ""
