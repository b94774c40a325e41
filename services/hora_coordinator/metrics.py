"""Prometheus metrics: read from the coordinator's job state at scrape time.

The coordinator already counts what matters per job (:class:`~.state.Job`'s
``negotiation_messages``, ``negotiated_tensors``, ``errors``). Rather than
keep a second copy of those counters in prometheus-client objects, which
would have to be updated on the hot path and could drift, a custom collector
turns the state into metric families whenever ``/metrics`` is scraped.

A scrape must not hold up the event loop that also serves gRPC: with
thousands of jobs, rendering the text takes long enough for heartbeats to
wait and healthy workers to be declared lost. So ``/metrics`` copies the
numbers on the loop a few hundred jobs at a time
(:func:`sample_jobs_sliced`) and renders them on a worker thread
(:func:`render_samples`).

Exported series::

    hora_negotiation_messages_total{job_id}   RequestLists received (counter)
    hora_negotiated_tensors_total{job_id}     tensors answered ready on every rank (counter)
    hora_negotiation_errors_total{job_id}     error responses sent (counter)
    hora_job_generation{job_id}               current generation, 0 while the first gathers
    hora_job_resets_total{job_id}             generations an elastic job formed after its first
    hora_job_members{job_id,state}            members by state; a gathering round's
                                              joiners count as "joining"
    hora_jobs{state}                          jobs by state
    hora_stream_messages_total{job_id}        messages queued on members' streams (counter)
    hora_stream_outboxes{job_id}              outboxes held for members (one per open or
                                              not yet opened stream)
    hora_stream_queued_messages{job_id}       messages waiting in them, not yet sent
    hora_job_events_dropped_total{job_id}     oldest events dropped from the job's bounded
                                              log (--max-events-per-job) (counter)
    hora_heartbeats_total{job_id,transport}   heartbeats answered: "unary" calls, and on
                                              negotiation streams ("stream")
    hora_lease_seconds{job_id}                the job's lease, sized to the load
    hora_heartbeat_interval_seconds{job_id}   how often its members renew it
    hora_job_steps_per_second{job_id}         the members' median step rate
    hora_job_samples_per_second{job_id}       summed over members that gave a batch size
    hora_job_messages_per_step{job_id}        coordinator messages per step, last 10 s
                                              (0 in steady state)
    hora_job_cache_hit_ratio{job_id}          tensors agreed from the response cache /
                                              all cacheable tensors
    hora_rank_steps_total{job_id,rank,host}   optimizer steps done by the rank (counter)
    hora_rank_steps_per_second{job_id,rank,host}
    hora_rank_straggler_lag_seconds{job_id,rank,host,quantile}
                                              how long after the first rank it arrives at
                                              agreement rounds (quantile 0.5 and 0.95)
    hora_rank_last_arrival_ratio{job_id,rank,host}
                                              share of rounds it arrived at last

The job-level telemetry series are absent until a member has reported (and
samples per second until a script gave its batch size); the per-rank ones
cover the active members that have reported.

Every state label value is always present (0 when empty), so a series does
not vanish when its last member or job moves on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from . import state
from .coordinator import Coordinator

__all__ = [
    "CONTENT_TYPE",
    "CoordinatorCollector",
    "JobSample",
    "create_registry",
    "render",
    "render_samples",
    "sample_jobs",
    "sample_jobs_sliced",
]

#: The ``Content-Type`` of :func:`render`'s output (Prometheus text format 0.0.4).
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Jobs sampled between two yields to the event loop in :func:`sample_jobs_sliced`.
_SLICE = 256


@dataclass(frozen=True)
class JobSample:
    """What the metrics show of one job, copied out of its state (safe on any thread)."""

    job_id: str
    phase: state.JobPhase
    negotiation_messages: int
    negotiated_tensors: int
    errors: int
    generation: int
    reset_count: int
    members: tuple[tuple[state.MemberState, int], ...]
    stream_messages: int
    outboxes: int
    queued: int
    events_dropped: int
    heartbeats: tuple[tuple[str, int], ...]  # (transport, count)
    lease_s: float
    interval_s: float
    # Telemetry: the newest sample of the job's series, and (rank, host, telemetry)
    # of each active member that reported.
    latest: state.Sample | None = None
    cache_hit_ratio: float | None = None
    ranks: tuple[tuple[int, str, state.RankTelemetry], ...] = ()


class _Sampler:
    """Copies jobs of one coordinator into :class:`JobSample`; call on its event loop."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._c = coordinator
        self._held = coordinator.outbox_counts()

    def __call__(self, job: state.Job) -> JobSample:
        boxes, waiting = self._held.get(job.job_id, (0, 0))
        reported = state.active_telemetry(job)
        runtime = self._c.runtimes.get(job.job_id)
        return JobSample(
            job_id=job.job_id,
            phase=job.phase,
            negotiation_messages=job.negotiation_messages,
            negotiated_tensors=job.negotiated_tensors,
            errors=job.errors,
            generation=job.generation,
            reset_count=job.reset_count,
            members=tuple(_member_counts(job).items()),
            stream_messages=runtime.messages_queued if runtime is not None else 0,
            outboxes=boxes,
            queued=waiting,
            events_dropped=job.events_dropped,
            heartbeats=tuple(
                (transport, runtime.heartbeats.get(transport, 0) if runtime is not None else 0)
                for transport in ("unary", "stream")
            ),
            lease_s=(lease := self._c.lease_of(job)).lease_s,
            interval_s=lease.interval_s,
            latest=job.series.latest if job.phase is state.JobPhase.RUNNING else None,
            cache_hit_ratio=_hit_ratio(reported.values()),
            ranks=tuple((rank, job.members[rank].host, t) for rank, t in reported.items()),
        )


def sample_jobs(coordinator: Coordinator) -> list[JobSample]:
    """Every job's sample at once; call on the coordinator's event loop."""
    sample = _Sampler(coordinator)
    return [sample(job) for job in coordinator.jobs.values()]


async def sample_jobs_sliced(coordinator: Coordinator) -> list[JobSample]:
    """Every job's sample, yielding to the event loop every few hundred jobs.

    Each job is copied whole in one step, so its sample is consistent; jobs
    that come or go between slices may or may not show (as in a scrape a
    moment earlier or later). The loop is never held for long, however many
    jobs there are.
    """
    sample = _Sampler(coordinator)
    jobs = list(coordinator.jobs.values())
    out: list[JobSample] = []
    for start in range(0, len(jobs), _SLICE):
        if start:
            await asyncio.sleep(0)
        out.extend(sample(job) for job in jobs[start:start + _SLICE])
    return out


def families(samples: Sequence[JobSample]) -> Iterator[Metric]:
    """The metric families listed in the module docstring, built from ``samples``."""
    messages = CounterMetricFamily(
        "hora_negotiation_messages",
        "Negotiation request lists received from the job's members.",
        labels=["job_id"],
    )
    tensors = CounterMetricFamily(
        "hora_negotiated_tensors",
        "Tensors negotiated ready on every rank of the job.",
        labels=["job_id"],
    )
    errors = CounterMetricFamily(
        "hora_negotiation_errors",
        "Error responses sent to the job's members (mismatches, failed sets, ...).",
        labels=["job_id"],
    )
    generation = GaugeMetricFamily(
        "hora_job_generation",
        "Current generation of the job; 0 while its first world gathers.",
        labels=["job_id"],
    )
    resets = CounterMetricFamily(
        "hora_job_resets",
        "Generations an elastic job formed after its first (elastic resets).",
        labels=["job_id"],
    )
    members = GaugeMetricFamily(
        "hora_job_members",
        "Members of the job by state; joiners of a gathering round are 'joining'.",
        labels=["job_id", "state"],
    )
    jobs = GaugeMetricFamily("hora_jobs", "Jobs by state.", labels=["state"])
    sent = CounterMetricFamily(
        "hora_stream_messages",
        "Messages queued on the negotiation streams of the job's members.",
        labels=["job_id"],
    )
    outboxes = GaugeMetricFamily(
        "hora_stream_outboxes",
        "Outboxes held for the job's members (open or not yet opened streams).",
        labels=["job_id"],
    )
    queued = GaugeMetricFamily(
        "hora_stream_queued_messages",
        "Messages waiting in the job's outboxes, not yet written to a stream.",
        labels=["job_id"],
    )
    dropped = CounterMetricFamily(
        "hora_job_events_dropped",
        "Oldest events dropped from the job's event log to keep it within its bound.",
        labels=["job_id"],
    )
    heartbeats = CounterMetricFamily(
        "hora_heartbeats",
        "Heartbeats of the job's members answered, by transport (unary calls, streams).",
        labels=["job_id", "transport"],
    )
    lease = GaugeMetricFamily(
        "hora_lease_seconds",
        "How long the job's members live without a heartbeat (sized to the load).",
        labels=["job_id"],
    )
    interval = GaugeMetricFamily(
        "hora_heartbeat_interval_seconds",
        "How often the job's members are asked to heartbeat (sized to the load).",
        labels=["job_id"],
    )
    by_phase = dict.fromkeys(state.JobPhase, 0)
    for job in samples:
        labels = [job.job_id]
        for transport, count in job.heartbeats:
            heartbeats.add_metric([job.job_id, transport], count)
        lease.add_metric(labels, job.lease_s)
        interval.add_metric(labels, job.interval_s)
        sent.add_metric(labels, job.stream_messages)
        outboxes.add_metric(labels, job.outboxes)
        queued.add_metric(labels, job.queued)
        by_phase[job.phase] += 1
        messages.add_metric(labels, job.negotiation_messages)
        tensors.add_metric(labels, job.negotiated_tensors)
        errors.add_metric(labels, job.errors)
        generation.add_metric(labels, job.generation)
        resets.add_metric(labels, job.reset_count)
        dropped.add_metric(labels, job.events_dropped)
        for member_state, count in job.members:
            members.add_metric([job.job_id, member_state.value], count)
    for phase, count in by_phase.items():
        jobs.add_metric([phase.value], count)
    yield from (messages, tensors, errors, generation, resets, members, jobs)
    yield from (sent, outboxes, queued, dropped, heartbeats, lease, interval)
    yield from _telemetry_families(samples)


class CoordinatorCollector(Collector):
    """Metric families of every job ``coordinator`` holds, built at each collect.

    Args:
        coordinator: The coordinator to read. Only read, on the caller's
            thread: call :meth:`collect` on the coordinator's event loop
            to see a consistent snapshot. The ``/metrics`` route instead
            samples on the loop (:func:`sample_jobs_sliced`) and renders the
            samples on a thread (:func:`render_samples`).
    """

    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

    def collect(self) -> Iterator[Metric]:
        """Yields the families listed in the module docstring."""
        yield from families(sample_jobs(self._coordinator))


class _Samples(Collector):
    def __init__(self, samples: Sequence[JobSample]) -> None:
        self._samples = samples

    def collect(self) -> Iterator[Metric]:
        yield from families(self._samples)


def _hit_ratio(telemetry: Iterable[state.RankTelemetry]) -> float | None:
    hits = misses = 0
    for t in telemetry:
        hits += t.cache_hits
        misses += t.cache_misses
    return hits / (hits + misses) if hits + misses else None


def _telemetry_families(samples: Iterable[JobSample]) -> Iterator[Metric]:
    """The job- and rank-level telemetry families."""
    job_label = ["job_id"]
    rank_labels = ["job_id", "rank", "host"]
    steps_rate = GaugeMetricFamily(
        "hora_job_steps_per_second", "The members' median steps per second.", labels=job_label)
    samples_rate = GaugeMetricFamily(
        "hora_job_samples_per_second",
        "Samples per second, summed over the members that gave their batch size.",
        labels=job_label)
    per_step = GaugeMetricFamily(
        "hora_job_messages_per_step",
        "Coordinator messages per training step over the last 10 s (0 in steady state).",
        labels=job_label)
    hit_ratio = GaugeMetricFamily(
        "hora_job_cache_hit_ratio",
        "Tensors agreed from the response cache, of all cacheable tensors.", labels=job_label)
    rank_steps = CounterMetricFamily(
        "hora_rank_steps", "Optimizer steps done by the rank's process.", labels=rank_labels)
    rank_rate = GaugeMetricFamily(
        "hora_rank_steps_per_second", "The rank's steps per second.", labels=rank_labels)
    lag = GaugeMetricFamily(
        "hora_rank_straggler_lag_seconds",
        "How long after the first rank this rank arrives at agreement rounds.",
        labels=[*rank_labels, "quantile"])
    last = GaugeMetricFamily(
        "hora_rank_last_arrival_ratio",
        "Share of the agreement rounds at which the rank arrived last.", labels=rank_labels)
    for job in samples:
        labels = [job.job_id]
        if job.latest is not None and job.ranks:
            steps_rate.add_metric(labels, job.latest.steps_per_s)
            if job.latest.samples_per_s is not None:
                samples_rate.add_metric(labels, job.latest.samples_per_s)
            if job.latest.messages_per_step is not None:
                per_step.add_metric(labels, job.latest.messages_per_step)
        if job.cache_hit_ratio is not None:
            hit_ratio.add_metric(labels, job.cache_hit_ratio)
        for rank, host, t in job.ranks:
            of_rank = [job.job_id, str(rank), host]
            rank_steps.add_metric(of_rank, t.steps)
            rank_rate.add_metric(of_rank, t.steps_per_s)
            lag.add_metric([*of_rank, "0.5"], t.lateness_p50_ms / 1000)
            lag.add_metric([*of_rank, "0.95"], t.lateness_p95_ms / 1000)
            last.add_metric(of_rank, t.last_share)
    yield from (steps_rate, samples_rate, per_step, hit_ratio, rank_steps, rank_rate, lag, last)


def _member_counts(job: state.Job) -> dict[state.MemberState, int]:
    counts = dict.fromkeys(state.MemberState, 0)
    for member in job.members:
        counts[member.state] += 1
    if job.round is not None:
        counts[state.MemberState.JOINING] += len(job.round.joiners)
    return counts


def create_registry(coordinator: Coordinator) -> CollectorRegistry:
    """A registry of its own holding only ``coordinator``'s collector.

    Not prometheus-client's global ``REGISTRY``: each app (and each test's
    coordinator) gets exactly its own series, and no process metrics sneak in.
    """
    registry = CollectorRegistry()
    registry.register(CoordinatorCollector(coordinator))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """``registry``'s metrics in the Prometheus text format."""
    return generate_latest(registry)


def render_samples(samples: Sequence[JobSample]) -> bytes:
    """The metrics of ``samples`` in the Prometheus text format; safe on any thread."""
    registry = CollectorRegistry()
    registry.register(_Samples(samples))
    return generate_latest(registry)
