"""The dashboard's data on REST: a job's rank map, telemetry and series, and live updates.

``GET /api/v1/jobs/{job_id}/ranks`` is the rank map: per rank its host,
local rank, pid, state, heartbeat age, steps and step time, and straggler
figures. ``GET /api/v1/jobs/{job_id}/telemetry`` adds the straggler summary,
the negotiation counters (response-cache hit ratio, coordinator messages per
step) and the job's series: world size, generation and throughput once a
second, with generations marked.

Live updates are server-sent events (``text/event-stream``), one stream per
page rather than a poll per endpoint:

- ``GET /api/v1/live``: event ``jobs``, the jobs list as ``GET /api/v1/jobs``
  serves it, whenever it changed (checked every :data:`LIVE_TICK_S`).
- ``GET /api/v1/jobs/{job_id}/live``: event ``job``, a :class:`JobLive`: the
  job, its telemetry, and the events and samples that are new since the
  previous message (the first message, marked ``reset``, holds them all).

Every number comes from the coordinator's state (:mod:`.state.telemetry`);
the page invents none. As in :mod:`.http`, values are copied on the event
loop and encoded on the render thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field, TypeAdapter
from starlette.background import BackgroundTask

from . import state
from .coordinator import Coordinator
from .http_common import (
    CoordinatorDep,
    EventView,
    JobDetail,
    JobStateName,
    MemberStateName,
    Renderer,
    RendererDep,
    job_detail_fields,
    job_or_404,
    json_response,
    list_job_rows,
    render_summaries,
    sliced,
)
from .http_live import LiveSlot, live_streams

__all__ = [
    "LIVE_TICK_S",
    "GenerationMarkView",
    "JobLive",
    "NegotiationView",
    "RankView",
    "SampleView",
    "StragglerView",
    "TelemetryView",
    "live_router",
    "telemetry_router",
]

#: How often a live stream checks for a change (seconds).
LIVE_TICK_S = 0.5
# A comment line keeps an idle stream's proxies from timing it out.
_KEEPALIVE_S = 15.0
# A heartbeat is late past this many of the member's heartbeat intervals.
_LATE_INTERVALS = 2.0
_EVENT_STREAM = "text/event-stream"


class RankView(BaseModel):
    """One rank on the rank map (a joiner of a gathering round shows as "joining")."""

    rank: int
    worker_id: str
    host: str
    local_rank: int
    pid: int
    state: MemberStateName
    cause: str = Field(description="why it was lost or left; empty otherwise")
    heartbeat_age_s: float = Field(description="seconds since its last heartbeat arrived")
    heartbeat_late: bool = Field(
        description="no heartbeat for more than two of its intervals while active"
    )
    reported: bool = Field(description="its heartbeats carried telemetry")
    steps: int = Field(description="optimizer steps done by its process")
    last_step_s: float = Field(description="how long its last step took")
    steps_per_s: float
    batch_size: int = Field(description="samples per step, when the script said; else 0")
    samples_per_s: float | None = Field(description="null when the script gave no batch size")
    rounds: int = Field(description="agreement rounds its straggler figures cover")
    lateness_p50_ms: float = Field(
        description="how long after the first rank it arrived at those rounds, median"
    )
    lateness_p95_ms: float
    last_arrivals: int = Field(description="rounds at which it arrived last")
    last_share: float = Field(description="last_arrivals / rounds")
    straggler: bool = Field(
        description="it arrives last far more often than chance, and late (p95 of 5 ms or more)")


class StragglerView(BaseModel):
    """The rank that most often arrives last at the agreement rounds."""

    slowest_rank: int | None = Field(description="null until ranks have reported rounds")
    host: str
    last_share: float = Field(description="share of the rounds it arrived at last")
    lateness_p50_ms: float
    lateness_p95_ms: float
    rounds: int
    is_straggler: bool = Field(
        description="last far more often than chance would have it, and late at the p95")


class NegotiationView(BaseModel):
    """How much the coordinator takes part in the steps."""

    negotiated_tensors: int
    negotiation_messages: int = Field(description="request lists the coordinator received")
    cache_hits: int = Field(description="tensors the ranks agreed from the response cache")
    cache_misses: int = Field(description="tensors the coordinator negotiated")
    cache_hit_ratio: float | None
    messages_per_step: float | None = Field(
        description="coordinator messages per step over the last 10 s (0 in steady "
        "state); null while no step was done"
    )


class SampleView(BaseModel):
    """The job, sampled once a second while it runs."""

    unix_ms: int
    generation: int
    size: int
    steps: int
    steps_per_s: float
    samples_per_s: float | None
    messages_per_step: float | None


class GenerationMarkView(BaseModel):
    """A generation as it formed."""

    unix_ms: int
    generation: int
    size: int
    reset: bool


class TelemetryView(BaseModel):
    """A job's rank map, straggler figures, negotiation and series."""

    job_id: str
    state: JobStateName
    generation: int
    size: int
    reset_count: int
    unix_ms: int = Field(description="the coordinator's clock when this was read")
    ranks: list[RankView]
    stragglers: StragglerView
    negotiation: NegotiationView
    series: list[SampleView]
    generations: list[GenerationMarkView]


class JobLive(BaseModel):
    """One message of a job's live stream."""

    reset: bool = Field(
        description="the first message: events and series hold everything kept; after "
        "it, only what is new"
    )
    job: JobDetail
    telemetry: TelemetryView
    events: list[EventView]


_RANKS = TypeAdapter(list[RankView])
_TELEMETRY = TypeAdapter(TelemetryView)
_LIVE = TypeAdapter(JobLive)


def _telemetry_fields(t: state.RankTelemetry | None, straggler: bool) -> dict[str, Any]:
    t = t or state.RankTelemetry()
    return {
        "steps": t.steps,
        "last_step_s": t.last_step_s,
        "steps_per_s": t.steps_per_s,
        "batch_size": t.batch_size,
        "samples_per_s": t.samples_per_s,
        "rounds": t.rounds,
        "lateness_p50_ms": t.lateness_p50_ms,
        "lateness_p95_ms": t.lateness_p95_ms,
        "last_arrivals": t.last_arrivals,
        "last_share": t.last_share,
        "straggler": straggler,
    }


class _RankCopier:
    """Copies a job's members and joiners into rank rows; call on the event loop."""

    def __init__(self, coordinator: Coordinator, job: state.Job) -> None:
        self._job = job
        self._now = coordinator.clock()
        self._size = job.size
        self._interval_s = coordinator.lease_of(job).interval_s

    def member(self, m: state.Member) -> dict[str, Any]:
        t = self._job.telemetry.get(m.worker_id)
        age = max(0.0, self._now - m.last_heartbeat)
        active = m.state is state.MemberState.ACTIVE
        return {
            "rank": m.rank,
            "worker_id": m.worker_id,
            "host": m.host,
            "local_rank": m.local_rank,
            "pid": m.pid,
            "state": m.state.value,
            "cause": m.cause,
            "heartbeat_age_s": round(age, 3),
            "heartbeat_late": active and age > _LATE_INTERVALS * self._interval_s,
            "reported": t is not None,
            **_telemetry_fields(t, active and t is not None
                                and state.is_straggler(t, self._size)),
        }

    def joiner(self, j: state.Joiner) -> dict[str, Any]:
        return {
            "rank": j.rank_hint,
            "worker_id": j.worker_id,
            "host": j.host,
            "local_rank": -1,
            "pid": j.pid,
            "state": "joining",
            "cause": "",
            "heartbeat_age_s": round(max(0.0, self._now - j.joined_at), 3),
            "heartbeat_late": False,
            "reported": False,
            **_telemetry_fields(None, False),
        }


async def _rank_rows(coordinator: Coordinator, job: state.Job) -> list[dict[str, Any]]:
    copier = _RankCopier(coordinator, job)
    joiners = list(job.round.joiners.values()) if job.round is not None else []
    rows = await sliced(job.members, copier.member)
    return rows + await sliced(joiners, copier.joiner)


def _negotiation_fields(job: state.Job, ranks: dict[int, state.RankTelemetry]
                        ) -> dict[str, Any]:
    hits = sum(t.cache_hits for t in ranks.values())
    misses = sum(t.cache_misses for t in ranks.values())
    latest = job.series.latest
    return {
        "negotiated_tensors": job.negotiated_tensors,
        "negotiation_messages": job.negotiation_messages,
        "cache_hits": hits,
        "cache_misses": misses,
        "cache_hit_ratio": hits / (hits + misses) if hits + misses else None,
        "messages_per_step": latest.messages_per_step if latest is not None else None,
    }


def _straggler_fields(job: state.Job, ranks: dict[int, state.RankTelemetry]) -> dict[str, Any]:
    summary = state.stragglers(ranks, job.size)
    host = ""
    if summary.slowest_rank is not None and summary.slowest_rank < len(job.members):
        host = job.members[summary.slowest_rank].host
    return {
        "slowest_rank": summary.slowest_rank,
        "host": host,
        "last_share": summary.last_share,
        "lateness_p50_ms": summary.lateness_p50_ms,
        "lateness_p95_ms": summary.lateness_p95_ms,
        "rounds": summary.rounds,
        "is_straggler": summary.is_straggler,
    }


async def _telemetry(coordinator: Coordinator, job: state.Job, since_ms: int = -1
                     ) -> dict[str, Any]:
    """The job's telemetry, its series and marks from after ``since_ms`` only."""
    ranks = state.active_telemetry(job)
    samples = [s for s in job.series.samples if s.unix_ms > since_ms]
    marks = [m for m in job.series.marks if m.unix_ms > since_ms]
    return {
        "job_id": job.job_id,
        "state": job.phase.value,
        "generation": job.generation,
        "size": job.size,
        "reset_count": job.reset_count,
        "unix_ms": int(coordinator.clock() * 1000),
        "ranks": await _rank_rows(coordinator, job),
        "stragglers": _straggler_fields(job, ranks),
        "negotiation": _negotiation_fields(job, ranks),
        # Frozen dataclasses: the render thread reads them as they are.
        "series": samples,
        "generations": marks,
    }


def _render_ranks(rows: list[dict[str, Any]]) -> bytes:
    return _RANKS.dump_json(_RANKS.validate_python(rows))


def _render_telemetry(fields: dict[str, Any]) -> bytes:
    return _TELEMETRY.dump_json(_TELEMETRY.validate_python(fields, from_attributes=True))


def _render_live(fields: dict[str, Any]) -> bytes:
    return _LIVE.dump_json(_LIVE.validate_python(fields, from_attributes=True))


telemetry_router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])
live_router = APIRouter(prefix="/api/v1", tags=["live"])


@telemetry_router.get(
    "/{job_id}/ranks", response_model=list[RankView],
    responses={404: {"description": "no such job"}},
)
async def list_ranks(job_id: str, coordinator: CoordinatorDep, render: RendererDep) -> Response:
    """The rank map: each member (and joiner) with its heartbeat age, steps and straggler
    figures, by rank."""
    job = job_or_404(coordinator, job_id)
    return json_response(await render(_render_ranks, await _rank_rows(coordinator, job)))


@telemetry_router.get(
    "/{job_id}/telemetry", response_model=TelemetryView,
    responses={404: {"description": "no such job"}},
)
async def get_telemetry(job_id: str, coordinator: CoordinatorDep, render: RendererDep,
                        since_ms: Annotated[int, Query(
                            description="only samples and generation marks after this "
                            "Unix time in ms (default: all kept)")] = -1,
                        ) -> Response:
    """Rank map, straggler summary, negotiation counters, and the job's series (world
    size, generation, throughput, messages per step; once a second, the last 15 min)."""
    job = job_or_404(coordinator, job_id)
    fields = await _telemetry(coordinator, job, since_ms)
    return json_response(await render(_render_telemetry, fields))


def _sse(event: str, body: bytes) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + body + b"\n\n"


async def _stream(request: Request, coordinator: Coordinator,
                  next_message: Callable[[], Any], slot: LiveSlot) -> AsyncIterator[bytes]:
    """Yields ``next_message()``'s bytes whenever they change, while the coordinator
    serves and the client listens; a comment line when idle for a while."""
    loop = asyncio.get_running_loop()
    last: bytes | None = None
    sent_at = loop.time()
    try:
        while coordinator.serving and not await request.is_disconnected():
            message = await next_message()
            if message is not None and message != last:  # heartbeat ages change: most do
                last = message
                sent_at = loop.time()
                yield message
            elif loop.time() - sent_at > _KEEPALIVE_S:
                sent_at = loop.time()
                yield b": keepalive\n\n"
            await asyncio.sleep(LIVE_TICK_S)
    finally:
        slot.release()


def _streaming(request: Request, coordinator: Coordinator,
               next_message: Callable[[], Any]) -> StreamingResponse:
    """A live stream, if one more fits under ``max_live_streams`` (503 otherwise)."""
    slot = live_streams(request).open(coordinator.settings.max_live_streams)
    return StreamingResponse(_stream(request, coordinator, next_message, slot),
                             media_type=_EVENT_STREAM, background=BackgroundTask(slot.release),
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


_LIVE_DOC = "server-sent events; each message's data is JSON"


@live_router.get(
    "/live", response_class=StreamingResponse,
    responses={200: {"content": {_EVENT_STREAM: {}}, "description": _LIVE_DOC
                     + ": event 'jobs', a list of JobSummary as GET /api/v1/jobs serves it"}},
)
async def live_jobs(request: Request, coordinator: CoordinatorDep, render: RendererDep,
                    offset: Annotated[int, Query(ge=0)] = 0,
                    limit: Annotated[int, Query(ge=1, le=1000)] = 200) -> StreamingResponse:
    """The jobs list, sent again whenever it changes."""

    async def jobs() -> bytes:
        rows, _total = await list_job_rows(coordinator, offset, limit)
        return _sse("jobs", await render(render_summaries, rows))

    # One computation per tick for every stream of the same page.
    shared = live_streams(request)
    return _streaming(request, coordinator, lambda: shared.tick(("jobs", offset, limit), jobs, LIVE_TICK_S))


class _JobFeed:
    """A job's live messages: the first holds everything kept, later ones what is new."""

    def __init__(self, coordinator: Coordinator, render: Renderer, job_id: str) -> None:
        self._c = coordinator
        self._render = render
        self._job_id = job_id
        self._events_seen = -1  # job.event_count at the last message
        self._since_ms = -1  # the newest sample or generation mark sent

    async def __call__(self) -> bytes | None:
        job = self._c.jobs.get(self._job_id)
        if job is None:
            return None
        reset = self._events_seen < 0
        new = len(job.events) if reset else min(len(job.events),
                                                 job.event_count - self._events_seen)
        events = list(job.events)[len(job.events) - new:] if new > 0 else []
        telemetry = await _telemetry(self._c, job, self._since_ms)
        self._events_seen = job.event_count
        for points in (telemetry["series"], telemetry["generations"]):
            if points:
                self._since_ms = max(self._since_ms, points[-1].unix_ms)
        fields = {"reset": reset, "job": await job_detail_fields(job, self._c),
                  "telemetry": telemetry, "events": events}
        return _sse("job", await self._render(_render_live, fields))


@live_router.get(
    "/jobs/{job_id}/live", response_class=StreamingResponse,
    responses={200: {"content": {_EVENT_STREAM: {}}, "description": _LIVE_DOC
                     + ": event 'job', a JobLive"},
               404: {"description": "no such job"}},
)
async def live_job(job_id: str, request: Request, coordinator: CoordinatorDep,
                   render: RendererDep) -> StreamingResponse:
    """The job, its telemetry and new events, sent whenever something changed."""
    job_or_404(coordinator, job_id)
    return _streaming(request, coordinator, _JobFeed(coordinator, render, job_id))
