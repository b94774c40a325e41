"""Members re-attaching after they lost the coordinator (its restart, an outage).

A worker that loses its stream keeps training on what it has already
negotiated and re-attaches when the coordinator answers again: same
generation, same rank, no reset. Each re-attaching member reports what it
knows (:class:`~hora_coordinator.messages.ReattachRequest`). A coordinator
that holds the job (it never went away, or restored it from its journal)
checks the report against it; one that does not know the job (restarted
without a journal) rebuilds it from the first report with
:func:`restore_job`. Either way every member gets one lease from then on to
re-attach; one that does not is lost, as after any silence, so a worker that
died during the outage is found once the coordinator is back.
"""

from __future__ import annotations

import logging

from hora_negotiation import NegotiationTable
from hora_proto.placement import place

from ..errors import InvalidRequestError, JobFailedError, PreconditionError, StaleGenerationError
from ..messages import ReattachRequest
from .effects import Effect, Log
from .elastic import elastic_bounds_of
from .job import EVENT_LOG_LIMIT, Job, JobPhase, Member, MemberState, new_job, record, round_config

__all__ = ["reattach", "restore_job"]


def restore_job(request: ReattachRequest, now: float, max_events: int = EVENT_LOG_LIMIT) -> Job:
    """A running job rebuilt from one member's report (its log keeps ``max_events``).

    Raises:
        InvalidRequestError: the report is not a consistent world (ranks not
            0..size-1, repeated or empty worker ids, the reporter not in it).
    """
    join = request.join
    members = sorted(request.members, key=lambda m: m.rank)
    size = len(members)
    if request.generation < 1 or size < 1:
        raise InvalidRequestError(
            f"worker {join.worker_id} reports no running generation of job '{join.job_id}'"
        )
    if [m.rank for m in members] != list(range(size)):
        raise InvalidRequestError(
            f"worker {join.worker_id} reports ranks {[m.rank for m in members]}, not 0..{size - 1}"
        )
    worker_ids = [m.worker_id for m in members]
    if len(set(worker_ids)) != size or not all(worker_ids):
        raise InvalidRequestError(
            f"worker {join.worker_id} reports empty or repeated worker ids"
        )
    if not 0 <= request.rank < size or worker_ids[request.rank] != join.worker_id:
        raise InvalidRequestError(
            f"worker {join.worker_id} reports rank {request.rank}, which another worker holds"
        )
    job = new_job(join.job_id, now, max_events)
    job.elastic = elastic_bounds_of(job, join)
    job.arrivals = size
    job.generation = request.generation
    job.config = round_config(join, size)
    placements, job.is_homogeneous = place([m.host for m in members])
    job.members = [
        Member(
            rank=m.rank,
            worker_id=m.worker_id,
            host=m.host,
            pid=m.pid,
            data_plane_address=m.data_plane_address,
            local_rank=p.local_rank,
            local_size=p.local_size,
            cross_rank=p.cross_rank,
            cross_size=p.cross_size,
            last_heartbeat=now,
        )
        for m, p in zip(members, placements, strict=True)
    ]
    job.by_worker = {m.worker_id: m for m in job.members}
    job.table = NegotiationTable(size, job.config.fusion_threshold_bytes)
    job.phase = JobPhase.RUNNING
    job.host_update_epoch = request.host_update_epoch
    # Not known after a restart without a journal: the members' own newest epoch is the
    # best guess (a retried Join's view then interrupts no one needlessly).
    job.generation_host_epoch = request.host_update_epoch
    job.history_restarted = True
    record(
        job,
        now,
        "restored",
        f"generation {job.generation} with {size} member(s) restored from the report of "
        f"rank {request.rank} after a coordinator restart; events before it were not kept "
        f"(no --state-dir)",
    )
    return job


def reattach(job: Job, request: ReattachRequest, now: float) -> list[Effect]:
    """A member of the running generation reports in again.

    Renews its lease and registers the process sets it reports (idempotent).

    Raises:
        JobFailedError: the job failed.
        StaleGenerationError: its generation is no longer the running one.
        PreconditionError: it is not an active member of it, or under another rank.
        InvalidRequestError: its process sets contradict the job's.
    """
    worker_id = request.join.worker_id
    if job.phase is JobPhase.FAILED:
        raise JobFailedError(f"job '{job.job_id}' has failed: {job.failure}")
    if job.phase is not JobPhase.RUNNING or request.generation != job.generation:
        raise StaleGenerationError(
            f"generation {request.generation} of job '{job.job_id}' is no longer running "
            f"(current generation {job.generation}, state {job.phase.value})"
        )
    member = job.by_worker.get(worker_id)
    if member is None or member.state is not MemberState.ACTIVE:
        cause = f" ({member.state.value}: {member.cause})" if member is not None else ""
        raise PreconditionError(
            f"worker {worker_id} is not an active member of job '{job.job_id}' generation "
            f"{job.generation}{cause}"
        )
    if member.rank != request.rank:
        raise PreconditionError(
            f"worker {worker_id} reports rank {request.rank}, but holds rank {member.rank} "
            f"of job '{job.job_id}' generation {job.generation}"
        )
    for set_id, ranks in sorted(request.process_sets.items()):
        job.table.add_process_set(set_id, ranks)
    member.last_heartbeat = now
    job.host_update_epoch = max(job.host_update_epoch, request.host_update_epoch)
    text = f"{member.describe()} re-attached after losing the coordinator"
    record(job, now, "reattach", text, member)
    return [Log(logging.INFO, f"job '{job.job_id}' generation {job.generation}: {text}")]
