"""The HTTP API: health probes, Prometheus metrics and read-only job state (FastAPI).

One router per resource. Routes only read state the coordinator owns; they
run on the coordinator's event loop, so they see a consistent snapshot
without locks, and they copy and render as :mod:`.http_common` says, so that
no read holds the loop long. ``GET /api/v1/jobs`` also pages
(``?offset=&limit=``; the header ``X-Total-Count`` says how many jobs there
are). The dashboard's data (rank map, telemetry, live streams) is in
:mod:`.http_telemetry`.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from . import metrics
from .coordinator import Coordinator
from .guessing import GuessLimiter
from .http_common import (
    CoordinatorDep,
    EventView,
    Health,
    JobDetail,
    JobSummary,
    Renderer,
    RendererDep,
    job_detail_fields,
    job_or_404,
    json_response,
    list_job_rows,
    render_detail,
    render_events,
    render_summaries,
)
from .http_guard import LoopbackHostGuard
from .http_telemetry import live_router, telemetry_router
from .rest_auth import SCOPE_JOB_KEY, TokenGuard, is_loopback

__all__ = ["create_app"]


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


@jobs_router.get("", response_model=list[JobSummary])
async def list_jobs(
    request: Request,
    coordinator: CoordinatorDep,
    render: RendererDep,
    offset: Annotated[int, Query(ge=0, description="jobs to skip, oldest first")] = 0,
    limit: Annotated[
        int | None, Query(ge=1, description="most jobs to answer (default: all)")
    ] = None,
) -> Response:
    """The jobs this coordinator holds, oldest first; ``X-Total-Count`` counts them all.
    A job token's holder sees its job only."""
    rows, total = await list_job_rows(coordinator, offset, limit,
                                      request.scope.get(SCOPE_JOB_KEY))
    body = await render(render_summaries, rows)
    return json_response(body, {"X-Total-Count": str(total)})


@jobs_router.get(
    "/{job_id}", response_model=JobDetail, responses={404: {"description": "no such job"}}
)
async def get_job(job_id: str, coordinator: CoordinatorDep, render: RendererDep) -> Response:
    """One job with its members; joiners of a gathering round show as "joining"."""
    job = job_or_404(coordinator, job_id)
    return json_response(await render(render_detail, await job_detail_fields(job, coordinator)))


@jobs_router.get(
    "/{job_id}/events",
    response_model=list[EventView],
    responses={404: {"description": "no such job"}},
)
async def list_events(job_id: str, coordinator: CoordinatorDep, render: RendererDep) -> Response:
    """The job's event log, oldest first (joins, generations, losses, resets, ...)."""
    # Events are frozen: the copied list is safe to read on the render thread.
    events = list(job_or_404(coordinator, job_id).events)
    return json_response(await render(render_events, events))


def create_app(coordinator: Coordinator) -> FastAPI:
    """The HTTP app serving ``coordinator``'s state; off loopback it wants the
    job token on every path but the health probes (:mod:`.rest_auth`), on
    loopback a loopback ``Host`` (:mod:`.http_guard`)."""
    # No /docs nor /redoc: they load Swagger UI from a CDN (issue 25); the schema
    # stays at /openapi.json for tools that render it themselves.
    app = FastAPI(title="hora coordinator", version="1", docs_url=None, redoc_url=None)
    settings = coordinator.settings
    if not is_loopback(settings.host):
        app.add_middleware(TokenGuard, token=settings.token, secure_cookie=settings.tls,
                           limiter=GuessLimiter(settings.guess_burst, settings.guess_rate))
    else:
        app.add_middleware(LoopbackHostGuard)
    app.state.coordinator = coordinator
    app.state.renderer = Renderer()
    app.include_router(health_router)
    app.include_router(metrics_router)
    app.include_router(jobs_router)
    app.include_router(telemetry_router)
    app.include_router(live_router)
    from .dashboard import router as dashboard_router  # the pages: / and /jobs/{job_id}

    app.include_router(dashboard_router)
    return app
