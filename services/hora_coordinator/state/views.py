"""What members and readers see of a job: world views, heartbeat replies, the event
log, and the active ranks' telemetry sampled into the job's series.

:class:`WorldView` and :class:`WorldMember` are the twins of ``hora.v1.WorldView``
and ``Member`` (same field names); :mod:`hora_coordinator.wire` encodes them.
The heartbeat answers' twins (:class:`HeartbeatReply`, :class:`StreamHeartbeatAnswer`)
are in :mod:`hora_coordinator.messages`, re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidRequestError, UnknownError, shown_id
from ..messages import HeartbeatReply, JobState, StreamHeartbeatAnswer
from .job import Job, JobEvent, JobPhase, Member, MemberState, record
from .telemetry import RankTelemetry, Sample

__all__ = [
    "JOB_STATE",
    "HeartbeatReply",
    "active_telemetry",
    "StreamHeartbeatAnswer",
    "WorldMember",
    "WorldView",
    "event_log",
    "get_world",
    "report_event",
    "sample_job",
    "world_members",
    "world_view",
]

#: A job's phase as a heartbeat reports it.
JOB_STATE = {
    JobPhase.GATHERING: JobState.GATHERING,
    JobPhase.RUNNING: JobState.RUNNING,
    JobPhase.FINISHED: JobState.FINISHED,
    JobPhase.FAILED: JobState.FAILED,
}


@dataclass(frozen=True)
class WorldMember:
    """One member of a generation as every member sees it (``hora.v1.Member``)."""

    rank: int
    worker_id: str
    host: str
    pid: int
    state: MemberState
    data_plane_address: str
    local_rank: int
    last_heartbeat_unix_ms: int


@dataclass(frozen=True)
class WorldView:
    """The world as one member sees it (``hora.v1.WorldView``)."""

    job_id: str
    generation: int
    size: int
    rank: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    is_homogeneous: bool
    members: tuple[WorldMember, ...]
    store_prefix: str
    host_update_epoch: int = 0


def world_members(job: Job) -> tuple[WorldMember, ...]:
    """The members of the current generation, by rank, as of now."""
    return tuple(
        WorldMember(
            rank=m.rank,
            worker_id=m.worker_id,
            host=m.host,
            pid=m.pid,
            state=m.state,
            data_plane_address=m.data_plane_address,
            local_rank=m.local_rank,
            last_heartbeat_unix_ms=int(m.last_heartbeat * 1000),
        )
        for m in job.members
    )


def world_view(
    job: Job, member: Member, members: tuple[WorldMember, ...] | None = None
) -> WorldView:
    """The world as ``member`` sees it.

    Args:
        members: :func:`world_members` of the same job state, shared by the
            views of a whole world admitted at once (O(1) per view, not O(size)).
    """
    return WorldView(
        job_id=job.job_id,
        generation=job.generation,
        size=len(job.members),
        rank=member.rank,
        local_rank=member.local_rank,
        local_size=member.local_size,
        cross_rank=member.cross_rank,
        cross_size=member.cross_size,
        is_homogeneous=job.is_homogeneous,
        members=members if members is not None else world_members(job),
        store_prefix=f"{job.job_id}/gen-{job.generation}/",
        host_update_epoch=job.generation_host_epoch,
    )


def get_world(job: Job, worker_id: str) -> WorldView:
    """The current view of a member of the current generation.

    Raises:
        UnknownError: the worker is not a member of the current generation.
    """
    member = job.by_worker.get(worker_id)
    if member is None:
        raise UnknownError(
            f"worker {shown_id(worker_id)} is not a member of job '{job.job_id}' "
            f"generation {job.generation}"
        )
    return world_view(job, member)


def report_event(job: Job, kind: str, host: str, message: str, now: float) -> None:
    """Records an event the launcher saw (a blacklisted host, a started worker, ...).

    Raises:
        InvalidRequestError: ``kind`` is empty.
    """
    if not kind:
        raise InvalidRequestError("an event needs a kind (e.g. 'blacklist')")
    record(job, now, kind, message, host=host)


def event_log(job: Job) -> list[JobEvent]:
    """The job's event log, oldest first (what ``ListEvents`` and ``/events`` serve)."""
    return list(job.events)


def active_telemetry(job: Job) -> dict[int, RankTelemetry]:
    """Rank -> the telemetry of each ACTIVE member that has reported any."""
    return {m.rank: t for m in job.members if m.state is MemberState.ACTIVE
            and (t := job.telemetry.get(m.worker_id)) is not None}


def sample_job(job: Job, now: float) -> Sample | None:
    """Adds a running job's sample at ``now`` to its series (None: not running)."""
    if job.phase is not JobPhase.RUNNING:
        return None
    return job.series.sample(now, job.generation, job.size,
                             list(active_telemetry(job).values()), job.negotiation_messages)
