"""Forming a generation from a gathered round (who gets which rank), and failing a job."""

from __future__ import annotations

import dataclasses
import logging

from hora_negotiation import NegotiationTable
from hora_proto.placement import place

from ..errors import JobFailedError
from ..messages import EventType
from .effects import Admit, Effect, Log, NewGeneration, Reject, Send, event_message
from .job import Job, JobPhase, Joiner, Member, Round, record
from .process_sets import abandon_set_calls
from .views import world_members, world_view

__all__ = [
    "elastic_order",
    "fail_job",
    "form_generation",
    "maybe_form",
    "order_joiners",
]


def order_joiners(joiners: list[Joiner], size: int) -> list[Joiner]:
    """Orders joiners by rank: hints first, the rest fill free ranks by (host, arrival).

    Hints are assumed unique and in range (:func:`.rendezvous.join` checks both).
    """
    slots: list[Joiner | None] = [None] * size
    for joiner in joiners:
        if joiner.rank_hint >= 0:
            slots[joiner.rank_hint] = joiner
    free = [rank for rank, slot in enumerate(slots) if slot is None]
    unhinted = sorted((j for j in joiners if j.rank_hint < 0), key=lambda j: (j.host, j.arrival))
    for rank, joiner in zip(free, unhinted, strict=True):
        slots[rank] = joiner
    return [slot for slot in slots if slot is not None]


def elastic_order(rnd: Round, max_size: int) -> tuple[list[Joiner], list[Joiner]]:
    """Who an elastic round admits, by new rank, and who waits for a later round.

    Members of the ended generation come first, in their old rank order (so
    rank 0 stays with the survivor of lowest rank); then newcomers, chosen by
    arrival up to ``max_size`` (0: no bound) and ranked by rank hint (hinted
    first), host, arrival.
    """
    previous = sorted(
        (j for j in rnd.joiners.values() if j.worker_id in rnd.previous),
        key=lambda j: rnd.previous[j.worker_id],
    )
    newcomers = sorted(
        (j for j in rnd.joiners.values() if j.worker_id not in rnd.previous),
        key=lambda j: j.arrival,
    )
    room = max_size - len(previous) if max_size else len(newcomers)
    chosen, later = newcomers[: max(0, room)], newcomers[max(0, room) :]
    chosen.sort(key=lambda j: (j.rank_hint < 0, j.rank_hint, j.host, j.arrival))
    return previous + chosen, later


def maybe_form(job: Job, now: float) -> list[Effect]:
    """Forms the next generation if its round is complete and none is running."""
    rnd = job.round
    if rnd is None or job.phase is JobPhase.RUNNING:
        return []  # the round waits until the running generation is over
    if job.elastic is not None:
        if not rnd.joiners or not rnd.expected <= rnd.joiners.keys():
            return []  # members of the ended generation re-join (or are lost) first
        if len(rnd.joiners) < max(job.elastic.min_size, rnd.wait_for):
            return []
        return form_generation(job, rnd, now)
    if len(rnd.joiners) < rnd.config.size:
        return []
    return form_generation(job, rnd, now)


def form_generation(job: Job, rnd: Round, now: float) -> list[Effect]:
    """Makes ``rnd``'s joiners the members of a new generation and admits them."""
    later: list[Joiner] = []
    if job.elastic is not None:
        ordered, later = elastic_order(rnd, job.elastic.max_size)
    else:
        ordered = order_joiners(list(rnd.joiners.values()), rnd.config.size)
    config = dataclasses.replace(rnd.config, size=len(ordered))
    kept = sum(1 for j in ordered if j.worker_id in rnd.previous)
    placements, homogeneous = place([j.host for j in ordered])
    job.generation += 1
    job.generation_host_epoch = job.host_update_epoch
    job.config = config
    job.round = None
    if later:  # beyond max_size: they wait for a later round
        job.round = Round(rnd.config, {j.worker_id: j for j in later}, opened_at=now)
    job.phase = JobPhase.RUNNING
    job.is_homogeneous = homogeneous
    job.members = [
        Member(
            rank=rank,
            worker_id=j.worker_id,
            host=j.host,
            pid=j.pid,
            data_plane_address=j.data_plane_address,
            local_rank=p.local_rank,
            local_size=p.local_size,
            cross_rank=p.cross_rank,
            cross_size=p.cross_size,
            last_heartbeat=now,
        )
        for rank, (j, p) in enumerate(zip(ordered, placements, strict=True))
    ]
    job.by_worker = {m.worker_id: m for m in job.members}
    job.telemetry = {w: t for w, t in job.telemetry.items() if w in job.by_worker}
    job.table = NegotiationTable(config.size, config.fusion_threshold_bytes)
    job.series.mark(now, job.generation, config.size, job.elastic is not None and job.generation > 1)
    text = f"generation {job.generation} formed with {config.size} member(s)"
    if job.elastic is not None and job.generation > 1:
        job.reset_count += 1
        text += f" ({kept} kept, {config.size - kept} new; reset {job.reset_count})"
    if later:
        text += f"; {len(later)} worker(s) wait for a later round (max_size)"
    record(job, now, "generation", text)
    effects: list[Effect] = [
        NewGeneration(job.generation, tuple(m.worker_id for m in job.members)),
        Log(logging.INFO, f"job '{job.job_id}': {text}"),
    ]
    members = world_members(job)
    effects.extend(Admit(m.worker_id, world_view(job, m, members)) for m in job.members)
    return effects


def fail_job(job: Job, failure: str, now: float) -> list[Effect]:
    """The job is FAILED: tell the members, fail their waiting process set calls,
    refuse the waiting joiners."""
    effects: list[Effect] = abandon_set_calls(job, failure)
    job.phase = JobPhase.FAILED
    job.failure = failure
    job.table.clear()
    record(job, now, "failed", failure)
    others = job.active_worker_ids()
    if others:
        effects.append(
            Send(
                others,
                event_message(
                    job,
                    EventType.JOB_FAILED,
                    now,
                    None,
                    f"job '{job.job_id}' failed: {failure}",
                ),
            )
        )
    rnd, job.round = job.round, None
    if rnd is not None:
        error = JobFailedError(f"job '{job.job_id}' has failed: {failure}")
        effects.extend(Reject(worker_id, error) for worker_id in rnd.joiners)
    return effects
