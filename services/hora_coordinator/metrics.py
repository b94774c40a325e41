"""Prometheus metrics: read from the coordinator's job state at scrape time.

The coordinator already counts what matters per job (:class:`~.state.Job`'s
``negotiation_messages``, ``negotiated_tensors``, ``errors``). Rather than
keep a second copy of those counters in prometheus-client objects, which
would have to be updated on the hot path and could drift, a custom collector
turns the state into metric families whenever ``/metrics`` is scraped.

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
    hora_heartbeats_total{job_id,transport}   heartbeats answered: "unary" calls, and on
                                              negotiation streams ("stream")
    hora_lease_seconds{job_id}                the job's lease, sized to the load
    hora_heartbeat_interval_seconds{job_id}   how often its members renew it

Every state label value is always present (0 when empty), so a series does
not vanish when its last member or job moves on.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from . import state
from .coordinator import Coordinator

__all__ = ["CONTENT_TYPE", "CoordinatorCollector", "create_registry", "render"]

#: The ``Content-Type`` of :func:`render`'s output (Prometheus text format 0.0.4).
CONTENT_TYPE = CONTENT_TYPE_LATEST


class CoordinatorCollector(Collector):
    """Metric families of every job ``coordinator`` holds, built at each collect.

    Args:
        coordinator: The coordinator to read. Only read, on the caller's
            thread: call :meth:`collect` on the coordinator's event loop
            (as the ``/metrics`` route does) to see a consistent snapshot.
    """

    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

    def collect(self) -> Iterator[Metric]:
        """Yields the families listed in the module docstring."""
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
        held = self._coordinator.outbox_counts()
        for job in self._coordinator.jobs.values():
            boxes, waiting = held.get(job.job_id, (0, 0))
            sent.add_metric([job.job_id], self._coordinator.messages_queued.get(job.job_id, 0))
            outboxes.add_metric([job.job_id], boxes)
            queued.add_metric([job.job_id], waiting)
            by_phase[job.phase] += 1
            for transport in ("unary", "stream"):
                count = self._coordinator.heartbeats.get((job.job_id, transport), 0)
                heartbeats.add_metric([job.job_id, transport], count)
            job_lease = self._coordinator.lease_of(job)
            lease.add_metric([job.job_id], job_lease.lease_s)
            interval.add_metric([job.job_id], job_lease.interval_s)
            messages.add_metric([job.job_id], job.negotiation_messages)
            tensors.add_metric([job.job_id], job.negotiated_tensors)
            errors.add_metric([job.job_id], job.errors)
            generation.add_metric([job.job_id], job.generation)
            resets.add_metric([job.job_id], job.reset_count)
            for member_state, count in _member_counts(job).items():
                members.add_metric([job.job_id, member_state.value], count)
        for phase, count in by_phase.items():
            jobs.add_metric([phase.value], count)
        yield from (messages, tensors, errors, generation, resets, members, jobs)
        yield from (sent, outboxes, queued, heartbeats, lease, interval)


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
