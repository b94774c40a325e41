"""What members and readers see of a job: world views and the event log."""

from __future__ import annotations

import dataclasses

from hora_proto.v1 import rendezvous_pb2 as rpb

from ..errors import InvalidRequestError, UnknownError
from .job import Job, JobEvent, JobPhase, Member, MemberState

__all__ = [
    "JOB_STATE_PB",
    "MEMBER_STATE_PB",
    "events_pb",
    "get_world",
    "member_pb",
    "report_event",
    "view_template",
    "world_view",
]


JOB_STATE_PB = {
    JobPhase.GATHERING: rpb.JOB_STATE_GATHERING,
    JobPhase.RUNNING: rpb.JOB_STATE_RUNNING,
    JobPhase.FINISHED: rpb.JOB_STATE_FINISHED,
    JobPhase.FAILED: rpb.JOB_STATE_FAILED,
}


MEMBER_STATE_PB = {
    MemberState.JOINING: rpb.MEMBER_STATE_JOINING,
    MemberState.ACTIVE: rpb.MEMBER_STATE_ACTIVE,
    MemberState.LEFT: rpb.MEMBER_STATE_LEFT,
    MemberState.LOST: rpb.MEMBER_STATE_LOST,
}


def world_view(job: Job, member: Member, template: rpb.WorldView | None = None) -> rpb.WorldView:
    """The world as ``member`` sees it.

    Args:
        template: A view of the same job state from :func:`view_template`;
            copying it (in C) beats rebuilding the member list per member when
            a whole world is admitted at once.
    """
    view = rpb.WorldView()
    view.CopyFrom(template if template is not None else view_template(job))
    view.rank = member.rank
    view.local_rank = member.local_rank
    view.local_size = member.local_size
    view.cross_rank = member.cross_rank
    view.cross_size = member.cross_size
    return view


def view_template(job: Job) -> rpb.WorldView:
    return rpb.WorldView(
        job_id=job.job_id,
        generation=job.generation,
        size=len(job.members),
        is_homogeneous=job.is_homogeneous,
        members=[member_pb(m) for m in job.members],
        store_prefix=f"{job.job_id}/gen-{job.generation}/",
    )


def member_pb(m: Member) -> rpb.Member:
    return rpb.Member(
        rank=m.rank,
        worker_id=m.worker_id,
        host=m.host,
        pid=m.pid,
        state=MEMBER_STATE_PB[m.state],
        data_plane_address=m.data_plane_address,
        local_rank=m.local_rank,
        last_heartbeat_unix_ms=int(m.last_heartbeat * 1000),
    )


def get_world(job: Job, worker_id: str) -> rpb.WorldView:
    """The current view of a member of the current generation.

    Raises:
        UnknownError: the worker is not a member of the current generation.
    """
    member = job.by_worker.get(worker_id)
    if member is None:
        raise UnknownError(
            f"worker {worker_id} is not a member of job '{job.job_id}' generation {job.generation}"
        )
    return world_view(job, member)


def report_event(job: Job, kind: str, host: str, message: str, now: float) -> None:
    """Records an event the launcher saw (a blacklisted host, a started worker, ...).

    Raises:
        InvalidRequestError: ``kind`` is empty.
    """
    if not kind:
        raise InvalidRequestError("an event needs a kind (e.g. 'blacklist')")
    job.events.append(JobEvent(int(now * 1000), kind, job.generation, -1, host, 0, message))


def events_pb(job: Job) -> list[rpb.JobEvent]:
    """The job's event log, oldest first, as protobuf messages."""
    return [rpb.JobEvent(**dataclasses.asdict(e)) for e in job.events]
