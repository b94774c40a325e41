"""The HTTP API: health probes, Prometheus metrics and read-only job state (FastAPI).

One router per resource. Routes only read state the coordinator owns; they
run on the coordinator's event loop, so they see a consistent snapshot
without locks. Response schemas (pydantic) are kept apart from the internal
dataclasses of :mod:`.state`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.registry import CollectorRegistry
from pydantic import BaseModel, Field

from . import metrics, state
from .coordinator import Coordinator
from .rest_auth import TokenGuard, is_loopback

__all__ = ["EventView", "JobDetail", "JobSummary", "MemberView", "create_app"]

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


class JobDetail(JobSummary):
    """A job and its members."""

    members: list[MemberView]


class EventView(BaseModel):
    """One entry of a job's event log; ``rank`` -1 and ``pid`` 0 when no member."""

    unix_ms: int
    kind: str
    generation: int
    rank: int
    host: str
    pid: int
    message: str


class Health(BaseModel):
    """Answer of the health probes."""

    status: str


def get_coordinator(request: Request) -> Coordinator:
    """The coordinator behind this app."""
    return request.app.state.coordinator


def get_metrics_registry(request: Request) -> CollectorRegistry:
    """The metrics registry of this app."""
    return request.app.state.metrics_registry


CoordinatorDep = Annotated[Coordinator, Depends(get_coordinator)]
MetricsRegistryDep = Annotated[CollectorRegistry, Depends(get_metrics_registry)]

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


# async on purpose: FastAPI runs a plain def route on a worker thread, where the
# collector would read job state while the event loop mutates it.
@metrics_router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {metrics.CONTENT_TYPE: {}}, "description": "Prometheus text"}},
)
async def get_metrics(registry: MetricsRegistryDep) -> Response:
    """Per-job negotiation counters, generations and members, in Prometheus text format."""
    return Response(content=metrics.render(registry), media_type=metrics.CONTENT_TYPE)


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
    }


def _members(job: state.Job) -> list[MemberView]:
    views = [
        MemberView(
            rank=m.rank,
            worker_id=m.worker_id,
            host=m.host,
            pid=m.pid,
            state=m.state.value,
            local_rank=m.local_rank,
            last_heartbeat=m.last_heartbeat,
            cause=m.cause,
        )
        for m in job.members
    ]
    if job.round is not None:
        views.extend(
            MemberView(
                rank=j.rank_hint,
                worker_id=j.worker_id,
                host=j.host,
                pid=j.pid,
                state="joining",
                local_rank=-1,
                last_heartbeat=j.joined_at,
            )
            for j in job.round.joiners.values()
        )
    return views


@jobs_router.get("", response_model=list[JobSummary])
async def list_jobs(coordinator: CoordinatorDep) -> list[JobSummary]:
    """Every job this coordinator has seen, oldest first."""
    return [JobSummary(**_summary_fields(job)) for job in coordinator.jobs.values()]


@jobs_router.get(
    "/{job_id}", response_model=JobDetail, responses={404: {"description": "no such job"}}
)
async def get_job(job_id: str, coordinator: CoordinatorDep) -> JobDetail:
    """One job with its members; joiners of a gathering round show as "joining"."""
    job = coordinator.jobs.get(job_id)
    if job is None:
        raise HTTPException(status_code=404, detail=f"unknown job '{job_id}'")
    return JobDetail(**_summary_fields(job), members=_members(job))


@jobs_router.get(
    "/{job_id}/events",
    response_model=list[EventView],
    responses={404: {"description": "no such job"}},
)
async def list_events(job_id: str, coordinator: CoordinatorDep) -> list[EventView]:
    """The job's event log, oldest first (joins, generations, losses, resets, ...)."""
    job = coordinator.jobs.get(job_id)
    if job is None:
        raise HTTPException(status_code=404, detail=f"unknown job '{job_id}'")
    return [EventView.model_validate(e, from_attributes=True) for e in job.events]


def create_app(coordinator: Coordinator) -> FastAPI:
    """The HTTP app serving ``coordinator``'s state; off loopback it wants the
    job token on every path but the health probes (:mod:`.rest_auth`)."""
    app = FastAPI(title="hora coordinator", version="1")
    settings = coordinator.settings
    if not is_loopback(settings.host):
        app.add_middleware(TokenGuard, token=settings.token, secure_cookie=settings.tls)
    app.state.coordinator = coordinator
    app.state.metrics_registry = metrics.create_registry(coordinator)
    app.include_router(health_router)
    app.include_router(metrics_router)
    app.include_router(jobs_router)
    return app
