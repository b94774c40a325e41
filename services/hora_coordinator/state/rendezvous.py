"""Joining the next generation, and giving up waiting."""

from __future__ import annotations

import logging

from ..errors import InvalidRequestError, JobFailedError, RoundFullError
from ..messages import JoinRequest
from .effects import Admit, Effect, Log
from .elastic import elastic_bounds_of, join_elastic
from .generations import maybe_form
from .job import Job, JobPhase, MemberState, Round, new_joiner, record, round_config
from .views import world_view

__all__ = [
    "abandoned",
    "cancel_join",
    "drop_joiner",
    "join",
]


def join(job: Job, request: JoinRequest, now: float) -> list[Effect]:
    """A worker asks to join the next generation.

    Returns:
        Admit effects for every joiner once the round is complete and no
        generation is running; else nothing (the joiner waits).

    Raises:
        InvalidRequestError: size contradicts the round's, hint out of range
            or taken, empty ids, the round is full, or elastic bounds that
            are out of order or contradict the job's.
        JobFailedError: the job has failed.
    """
    if not request.worker_id:
        raise InvalidRequestError("worker_id must not be empty")
    if job.phase is JobPhase.FAILED:
        raise JobFailedError(f"job '{job.job_id}' has failed: {job.failure}")
    elastic = elastic_bounds_of(job, request)
    member = job.by_worker.get(request.worker_id)
    if member is not None and member.state is MemberState.ACTIVE and job.phase is JobPhase.RUNNING:
        # A retry after the answer got lost: same generation, same view.
        return [Admit(request.worker_id, world_view(job, member))]
    size = request.expected_size
    if size < 1:
        raise InvalidRequestError(f"expected_size must be at least 1, got {size}")
    if elastic is not None:
        job.elastic = elastic
        return join_elastic(job, elastic, request, now)
    rnd = job.round
    if rnd is not None and rnd.config.size != size:
        raise InvalidRequestError(
            f"job '{job.job_id}' gathers a world of size {rnd.config.size} (set by its first "
            f"joiner), but worker {request.worker_id} expects size {size}"
        )
    hint = request.rank_hint
    if not -1 <= hint < size:
        raise InvalidRequestError(f"rank hint {hint} is outside [0, {size}) (or -1 for any)")
    retry = False
    if rnd is not None:
        holder = rnd.hints.get(hint) if hint >= 0 else None
        if holder is not None and holder != request.worker_id:
            other = rnd.joiners[holder]
            raise InvalidRequestError(
                f"rank hint {hint} is already taken by worker {holder} "
                f"(host {other.host}, pid {other.pid})"
            )
        retry = request.worker_id in rnd.joiners
        others = len(rnd.joiners) - retry
        if others >= size:
            raise RoundFullError(
                f"job '{job.job_id}' already has {size} joiners for its next generation"
            )
        drop_joiner(rnd, request.worker_id)  # a retry of a pending Join replaces it
    else:
        rnd = job.round = Round(round_config(request, size))
    joiner = rnd.joiners[request.worker_id] = new_joiner(job, request, now)
    if hint >= 0:
        rnd.hints[hint] = request.worker_id
    if not retry:
        record(
            job,
            now,
            "join",
            f"worker {request.worker_id} joined ({len(rnd.joiners)} of {size})",
            joiner,
            rank=hint,
        )
    return maybe_form(job, now)


def drop_joiner(rnd: Round, worker_id: str) -> None:
    """Forgets a joiner of ``rnd`` and frees its rank hint."""
    joiner = rnd.joiners.pop(worker_id, None)
    if joiner is not None and joiner.rank_hint >= 0:
        rnd.hints.pop(joiner.rank_hint, None)


def abandoned(job: Job) -> bool:
    """Whether ``job`` never formed a world and nobody waits to join it any more.

    Such a job holds nothing worth keeping (no member, no event that matters
    after its joiners gave up): the coordinator forgets it.
    """
    return job.phase is JobPhase.GATHERING and job.generation == 0 and job.round is None


def cancel_join(job: Job, worker_id: str, now: float | None = None) -> list[Effect]:
    """A pending joiner's deadline passed: forget it (an empty round forgets its config).

    A member of an ended elastic generation stays expected: it may Join again
    within a lease, counted from ``now`` (its Join call was alive until then).
    """
    rnd = job.round
    if rnd is None or worker_id not in rnd.joiners:
        return []
    drop_joiner(rnd, worker_id)
    member = job.by_worker.get(worker_id)
    if worker_id in rnd.expected and member is not None and now is not None:
        member.last_heartbeat = max(member.last_heartbeat, now)
    if not rnd.joiners and not rnd.follows_generation:
        job.round = None
    return [Log(logging.INFO, f"job '{job.job_id}': worker {worker_id} stopped waiting to join")]
