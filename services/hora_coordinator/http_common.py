"""What the HTTP routes share: response models, copying state off the loop, rendering.

Routes run on the coordinator's event loop, which also serves gRPC, so a read
must not hold it long, however many jobs there are: a route copies what it
shows into plain values on the loop, a few hundred items at a time
(:func:`sliced`), and validates and encodes them on one worker thread
(:class:`Renderer`). Response schemas (pydantic) are kept apart from the
internal dataclasses of :mod:`.state`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Depends, HTTPException, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, TypeAdapter

from . import state
from .coordinator import Coordinator

__all__ = [
    "CoordinatorDep",
    "EventView",
    "Health",
    "JobDetail",
    "JobStateName",
    "JobSummary",
    "MemberStateName",
    "MemberView",
    "Renderer",
    "RendererDep",
    "job_detail_fields",
    "job_or_404",
    "json_response",
    "list_job_rows",
    "render_detail",
    "render_events",
    "render_summaries",
    "sliced",
]

JobStateName = Literal["gathering", "running", "finished", "failed"]
MemberStateName = Literal["joining", "active", "left", "lost"]


class MemberView(BaseModel):
    """One member (or, while gathering, one joiner) of a job."""

    rank: int
    worker_id: str
    host: str
    pid: int
    state: MemberStateName
    local_rank: int
    last_heartbeat: float
    cause: str = ""


class EventView(BaseModel):
    """One entry of a job's event log; ``rank`` -1 and ``pid`` 0 when no member."""

    unix_ms: int
    kind: str
    generation: int
    rank: int
    host: str
    pid: int
    message: str


class JobSummary(BaseModel):
    """A job at a glance."""

    job_id: str
    state: JobStateName
    failure: str
    generation: int
    size: int
    negotiated_tensors: int
    errors: int
    negotiation_messages: int
    created_at: float
    elastic: bool
    min_size: int
    max_size: int
    reset_count: int
    host_update_epoch: int
    history_restarted: bool = Field(
        description="the coordinator restarted without a journal (--state-dir) and rebuilt "
        "this job from its members' reports: its event log starts at the restart"
    )
    events_dropped: int = Field(
        description="oldest events dropped from the job's log to keep it within "
        "the coordinator's --max-events-per-job"
    )
    age_s: float = Field(description="seconds since the job's first Join")
    steps_per_s: float = Field(
        description="the members' median steps per second, as their heartbeats report it"
    )
    last_event: EventView | None = Field(description="the newest event of its log")


class JobDetail(JobSummary):
    """A job and its members."""

    members: list[MemberView]
    job_options: dict[str, str] = Field(
        description="the job-level options (fusion threshold, stall times, elastic sizes "
        "and timeout...) by name, as the job's first joiner sent them, in each option's "
        "unit (seconds, bytes)"
    )


class Health(BaseModel):
    """Answer of the health probes."""

    status: str


_T = TypeVar("_T")
_R = TypeVar("_R")
# Items copied between two yields to the event loop.
_SLICE = 256
_SUMMARIES = TypeAdapter(list[JobSummary])
_DETAIL = TypeAdapter(JobDetail)
_EVENTS = TypeAdapter(list[EventView])


class Renderer:
    """The one worker thread that validates and encodes what the routes send.

    One thread, not a pool: every thread that renders competes with the
    event loop for the GIL, and one keeps the loop's share high however many
    scrapes arrive at once (they queue here instead).
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hora-http-render")

    async def __call__(self, render: Callable[[_T], _R], values: _T) -> _R:
        """``render(values)`` on the worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, render, values)

    def close(self) -> None:
        """Lets the thread end once the renders it holds are done."""
        self._pool.shutdown(wait=False)


async def sliced(items: Iterable[_T], copy: Callable[[_T], _R]) -> list[_R]:
    """``[copy(item) for item in items]``, yielding to the event loop every few hundred."""
    listed = list(items)
    out: list[_R] = []
    for start in range(0, len(listed), _SLICE):
        if start:
            await asyncio.sleep(0)
        out.extend(copy(item) for item in listed[start:start + _SLICE])
    return out


def json_response(body: bytes, headers: dict[str, str] | None = None) -> Response:
    return Response(content=body, media_type="application/json", headers=headers)


def get_coordinator(request: Request) -> Coordinator:
    """The coordinator behind this app."""
    return request.app.state.coordinator


def get_renderer(request: Request) -> Renderer:
    """The render thread of this app."""
    return request.app.state.renderer


CoordinatorDep = Annotated[Coordinator, Depends(get_coordinator)]
RendererDep = Annotated[Renderer, Depends(get_renderer)]

class _SummaryCopier:
    """Copies jobs into summary rows; call on the event loop."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._now = coordinator.clock()

    def __call__(self, job: state.Job) -> dict[str, Any]:
        return {
            **_summary_fields(job),
            "age_s": round(max(0.0, self._now - job.created_at), 3),
            "steps_per_s": state.job_rates(list(state.active_telemetry(job).values()))[0],
            "last_event": dataclasses.asdict(job.events[-1]) if job.events else None,
        }


def _summary_fields(job: state.Job) -> dict[str, Any]:
    return {
        "job_id": job.job_id,
        "state": job.phase.value,
        "failure": job.failure,
        "generation": job.generation,
        "size": job.size,
        "negotiated_tensors": job.negotiated_tensors,
        "errors": job.errors,
        "negotiation_messages": job.negotiation_messages,
        "created_at": job.created_at,
        "elastic": job.elastic is not None,
        "min_size": job.elastic.min_size if job.elastic is not None else 0,
        "max_size": job.elastic.max_size if job.elastic is not None else 0,
        "reset_count": job.reset_count,
        "host_update_epoch": job.host_update_epoch,
        "history_restarted": job.history_restarted,
        "events_dropped": job.events_dropped,
    }


def _member_fields(m: state.Member) -> dict[str, Any]:
    return {
        "rank": m.rank,
        "worker_id": m.worker_id,
        "host": m.host,
        "pid": m.pid,
        "state": m.state.value,
        "local_rank": m.local_rank,
        "last_heartbeat": m.last_heartbeat,
        "cause": m.cause,
    }


def _joiner_fields(j: state.Joiner) -> dict[str, Any]:
    return {
        "rank": j.rank_hint,
        "worker_id": j.worker_id,
        "host": j.host,
        "pid": j.pid,
        "state": "joining",
        "local_rank": -1,
        "last_heartbeat": j.joined_at,
    }


def job_or_404(coordinator: Coordinator, job_id: str) -> state.Job:
    job = coordinator.jobs.get(job_id)
    if job is None:
        raise HTTPException(status_code=404, detail=f"unknown job '{job_id}'")
    return job


def render_summaries(rows: list[dict[str, Any]]) -> bytes:
    return _SUMMARIES.dump_json(_SUMMARIES.validate_python(rows))


def render_detail(fields: dict[str, Any]) -> bytes:
    return _DETAIL.dump_json(_DETAIL.validate_python(fields))


def render_events(events: list[state.JobEvent]) -> bytes:
    return _EVENTS.dump_json(_EVENTS.validate_python(events, from_attributes=True))


async def list_job_rows(coordinator: Coordinator, offset: int, limit: int | None,
                        only: str | None = None) -> tuple[list[dict[str, Any]], int]:
    """Summary rows of a page of jobs (oldest first), and how many jobs there are;
    with ``only`` (a job token's job), of that job alone."""
    if only is not None:
        one = coordinator.jobs.get(only)
        jobs = [one] if one is not None else []
    else:
        jobs = list(coordinator.jobs.values())
    page = jobs[offset:] if limit is None else jobs[offset:offset + limit]
    return await sliced(page, _SummaryCopier(coordinator)), len(jobs)


async def job_detail_fields(job: state.Job, coordinator: Coordinator) -> dict[str, Any]:
    """A job's summary and members, copied for rendering as a :class:`JobDetail`."""
    joiners = list(job.round.joiners.values()) if job.round is not None else []
    members = await sliced(job.members, _member_fields)
    members += await sliced(joiners, _joiner_fields)
    config = job.config if job.config is not None else (
        job.round.config if job.round is not None else None)
    options = dict(config.job_options) if config is not None else {}
    return {**_SummaryCopier(coordinator)(job), "members": members, "job_options": options}


