"""The HTTP API: health probes, Prometheus metrics and read-only job state (FastAPI).

One router per resource. Routes only read state the coordinator owns; they
run on the coordinator's event loop, so they see a consistent snapshot
without locks. Response schemas (pydantic) are kept apart from the internal
dataclasses of :mod:`.state`.

That loop also serves gRPC, so a read must not hold it long, however many
jobs there are: a route copies what it shows into plain values on the loop,
a few hundred jobs at a time (:func:`sliced`), and validates and encodes
them on one worker thread (:class:`Renderer`). ``GET /api/v1/jobs`` also
pages (``?offset=&limit=``; the header ``X-Total-Count`` says how many jobs
there are).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, TypeAdapter

from . import metrics, state
from .coordinator import Coordinator
from .rest_auth import TokenGuard, is_loopback

__all__ = [
    "CoordinatorDep",
    "EventView",
    "JobDetail",
    "JobSummary",
    "MemberView",
    "Renderer",
    "RendererDep",
    "create_app",
    "job_detail_fields",
    "job_or_404",
    "json_response",
    "list_job_rows",
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

health_router = APIRouter(tags=["health"])
metrics_router = APIRouter(tags=["metrics"])
jobs_router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])


@health_router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is up."""
    return Health(status="ok")


@health_router.get(
    "/readyz",
    response_model=Health,
    responses={503: {"model": Health, "description": "gRPC not serving"}},
)
async def readyz(coordinator: CoordinatorDep) -> Health | JSONResponse:
    """The gRPC server is serving."""
    if coordinator.serving:
        return Health(status="ready")
    return JSONResponse(status_code=503, content={"status": "not serving"})


# async on purpose: FastAPI runs a plain def route on a worker thread, where it
# would read job state while the event loop mutates it. The state is copied on
# the loop; only the copies go to the render thread.
@metrics_router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {metrics.CONTENT_TYPE: {}}, "description": "Prometheus text"}},
)
async def get_metrics(coordinator: CoordinatorDep, render: RendererDep) -> Response:
    """Per-job negotiation counters, generations and members, in Prometheus text format."""
    samples = await metrics.sample_jobs_sliced(coordinator)
    body = await render(metrics.render_samples, samples)
    return Response(content=body, media_type=metrics.CONTENT_TYPE)


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


def _render_detail(fields: dict[str, Any]) -> bytes:
    return _DETAIL.dump_json(_DETAIL.validate_python(fields))


def _render_events(events: list[state.JobEvent]) -> bytes:
    return _EVENTS.dump_json(_EVENTS.validate_python(events, from_attributes=True))


@jobs_router.get("", response_model=list[JobSummary])
async def list_jobs(
    coordinator: CoordinatorDep,
    render: RendererDep,
    offset: Annotated[int, Query(ge=0, description="jobs to skip, oldest first")] = 0,
    limit: Annotated[
        int | None, Query(ge=1, description="most jobs to answer (default: all)")
    ] = None,
) -> Response:
    """The jobs this coordinator holds, oldest first; ``X-Total-Count`` counts them all."""
    rows, total = await list_job_rows(coordinator, offset, limit)
    body = await render(render_summaries, rows)
    return json_response(body, {"X-Total-Count": str(total)})


async def list_job_rows(coordinator: Coordinator, offset: int, limit: int | None
                        ) -> tuple[list[dict[str, Any]], int]:
    """Summary rows of a page of jobs (oldest first), and how many jobs there are."""
    jobs = list(coordinator.jobs.values())
    page = jobs[offset:] if limit is None else jobs[offset:offset + limit]
    return await sliced(page, _SummaryCopier(coordinator)), len(jobs)


@jobs_router.get(
    "/{job_id}", response_model=JobDetail, responses={404: {"description": "no such job"}}
)
async def get_job(job_id: str, coordinator: CoordinatorDep, render: RendererDep) -> Response:
    """One job with its members; joiners of a gathering round show as "joining"."""
    job = job_or_404(coordinator, job_id)
    return json_response(await render(_render_detail, await job_detail_fields(job, coordinator)))


async def job_detail_fields(job: state.Job, coordinator: Coordinator) -> dict[str, Any]:
    """A job's summary and members, copied for rendering as a :class:`JobDetail`."""
    joiners = list(job.round.joiners.values()) if job.round is not None else []
    members = await sliced(job.members, _member_fields)
    members += await sliced(joiners, _joiner_fields)
    return {**_SummaryCopier(coordinator)(job), "members": members}


@jobs_router.get(
    "/{job_id}/events",
    response_model=list[EventView],
    responses={404: {"description": "no such job"}},
)
async def list_events(job_id: str, coordinator: CoordinatorDep, render: RendererDep) -> Response:
    """The job's event log, oldest first (joins, generations, losses, resets, ...)."""
    # Events are frozen: the copied list is safe to read on the render thread.
    events = list(job_or_404(coordinator, job_id).events)
    return json_response(await render(_render_events, events))


def create_app(coordinator: Coordinator) -> FastAPI:
    """The HTTP app serving ``coordinator``'s state; off loopback it wants the
    job token on every path but the health probes (:mod:`.rest_auth`)."""
    app = FastAPI(title="hora coordinator", version="1")
    settings = coordinator.settings
    if not is_loopback(settings.host):
        app.add_middleware(TokenGuard, token=settings.token, secure_cookie=settings.tls)
    app.state.coordinator = coordinator
    app.state.renderer = Renderer()
    app.include_router(health_router)
    app.include_router(metrics_router)
    app.include_router(jobs_router)
    # Late import: those routes build on this module's models and helpers.
    from .http_telemetry import live_router, telemetry_router

    app.include_router(telemetry_router)
    app.include_router(live_router)
    from .dashboard import router as dashboard_router  # the pages: / and /jobs/{job_id}

    app.include_router(dashboard_router)
    return app
