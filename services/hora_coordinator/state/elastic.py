"""Elastic jobs: bounds, joins while running, the end of a generation, round deadlines."""

from __future__ import annotations

import logging

from ..errors import InvalidRequestError
from ..messages import JoinRequest
from .effects import Effect, Log
from .generations import fail_job, maybe_form
from .job import (
    DEFAULT_ELASTIC_TIMEOUT_S,
    ElasticBounds,
    Job,
    JobConfig,
    JobPhase,
    Member,
    MemberState,
    Round,
    new_joiner,
    record,
    round_config,
)
from .leases import expired
from .process_sets import abandon_set_calls

__all__ = [
    "NEWCOMER_GATHER_LEASES",
    "announce_newcomers",
    "check_newcomers",
    "check_round",
    "elastic_bounds_of",
    "end_generation",
    "join_elastic",
    "lose_before_rejoining",
]


# Leases workers launched together may take to all arrive (each imports its
# framework): how long a newcomer waits for its companions before the running
# generation is told of those that came, and how long a round waiting for its
# launched size waits after the last arrival.
NEWCOMER_GATHER_LEASES = 5


def elastic_bounds_of(job: Job, request: JoinRequest) -> ElasticBounds | None:
    """The elastic bounds the request asks for, checked against the job's.

    Raises:
        InvalidRequestError: bounds out of order, or elasticity that contradicts
            the job's (set by its first joiner).
    """
    wants = request.min_size > 0 or request.max_size > 0
    if request.min_size < 0 or request.max_size < 0:
        raise InvalidRequestError(
            f"min_size and max_size must not be negative, got {request.min_size} and "
            f"{request.max_size}"
        )
    if job.arrivals > 0:
        if wants != (job.elastic is not None):
            kind = "elastic" if job.elastic is not None else "not elastic"
            raise InvalidRequestError(
                f"job '{job.job_id}' is {kind} (set by its first joiner), but worker "
                f"{request.worker_id} asks for min_size {request.min_size}, "
                f"max_size {request.max_size}"
            )
        return job.elastic
    if not wants:
        return None
    min_size = max(1, request.min_size)
    if request.max_size and request.max_size < min_size:
        raise InvalidRequestError(f"max_size {request.max_size} is below min_size {min_size}")
    timeout_s = request.elastic_timeout_ms / 1000.0 if request.elastic_timeout_ms > 0 else 0.0
    return ElasticBounds(min_size, request.max_size, timeout_s or DEFAULT_ELASTIC_TIMEOUT_S)


def join_elastic(
    job: Job, elastic: ElasticBounds, request: JoinRequest, now: float
) -> list[Effect]:
    """Join of an elastic job: rank hints only order newcomers; rounds are never full."""
    worker_id = request.worker_id
    if request.rank_hint < -1:
        raise InvalidRequestError(
            f"rank hint {request.rank_hint} must be -1 (any) or a rank, not negative"
        )
    rnd = job.round
    if rnd is None:
        rnd = job.round = Round(round_config(request, request.expected_size), opened_at=now)
        if job.phase is not JobPhase.RUNNING:  # a first round: wait for the launched world
            rnd.wait_for = elastic.clamp(request.expected_size)
    retry = worker_id in rnd.joiners
    rnd.joiners.pop(worker_id, None)  # a retry of a pending Join replaces it
    joiner = rnd.joiners[worker_id] = new_joiner(job, request, now)
    if worker_id not in job.by_worker:
        rnd.launched = max(rnd.launched, request.expected_size)
    effects: list[Effect] = []
    if retry:
        return maybe_form(job, now)
    old_rank = rnd.previous.get(worker_id)
    member = job.by_worker.get(worker_id)
    if old_rank is not None and member is not None and member.state is MemberState.ACTIVE:
        # Joining again is leaving the ended generation, even without Leave(rejoin).
        member.state, member.rejoin, member.cause = MemberState.LEFT, True, "reset"
    text = f"worker {worker_id} joined"
    if old_rank is not None:
        text += f" (rank {old_rank} of generation {job.generation})"
    record(job, now, "join", text, joiner)
    if job.phase is JobPhase.RUNNING and elastic.below_max(len(job.members)):
        newcomers = sum(1 for w in rnd.joiners if w not in job.by_worker)
        if len(job.members) + newcomers >= elastic.clamp(rnd.launched):
            effects.extend(announce_newcomers(job, now))
        elif rnd.gathering_since is None:
            # Launched with others still on their way: tell the running
            # generation once they are all here (one reset for all of them),
            # or when waiting for them has taken long enough (check_newcomers).
            rnd.gathering_since = now
    effects.extend(maybe_form(job, now))
    return effects


def announce_newcomers(job: Job, now: float) -> list[Effect]:
    """Tells the running generation that newcomers wait (a new host update epoch:
    every member interrupts at its next commit)."""
    rnd = job.round
    if rnd is None or job.phase is not JobPhase.RUNNING:
        return []
    rnd.gathering_since = None
    waiting = [j for w, j in rnd.joiners.items() if w not in job.by_worker]
    if not waiting:
        return []
    job.host_update_epoch += 1
    job.removals_only = False
    hosts = ", ".join(sorted({j.host for j in waiting}))
    message = (
        f"{len(waiting)} worker(s) (host {hosts}) wait to join running generation "
        f"{job.generation} of {len(job.members)} member(s); host update epoch "
        f"{job.host_update_epoch}"
    )
    record(job, now, "join_waiting", message, waiting[-1])
    return [Log(logging.INFO, f"job '{job.job_id}': {message}")]


def check_newcomers(job: Job, now: float, lease_s: float) -> list[Effect]:
    """Stops waiting for newcomers' companions after :data:`NEWCOMER_GATHER_LEASES`
    leases: the running generation is told of the newcomers that came."""
    rnd = job.round
    if rnd is None or rnd.gathering_since is None:
        return []
    if now - rnd.gathering_since < NEWCOMER_GATHER_LEASES * lease_s:
        return []
    return announce_newcomers(job, now)


def end_generation(job: Job, now: float, why: str) -> list[Effect]:
    """An elastic generation is over: open the round that expects its survivors.

    Process set calls still waiting fail (``why`` says why).
    """
    effects: list[Effect] = abandon_set_calls(job, why)
    job.table.clear()
    job.phase = JobPhase.GATHERING
    previous = {
        m.worker_id: m.rank
        for m in job.members
        if m.state is MemberState.ACTIVE or (m.state is MemberState.LEFT and m.rejoin)
    }
    rnd = job.round
    if rnd is None:
        rnd = job.round = Round(job.config or JobConfig(size=len(job.members)))
    rnd.previous, rnd.expected = previous, set(previous)
    # Newcomers launched together (horarun starts a new host's workers at
    # once) join one generation, not one each.
    waits = job.elastic.clamp(rnd.launched) if rnd.launched and job.elastic else 0
    rnd.opened_at, rnd.wait_for, rnd.follows_generation = now, waits, True
    newcomers = len(rnd.joiners)
    effects.append(
        Log(
            logging.INFO,
            f"job '{job.job_id}': generation {job.generation} is over ({why}); the next "
            f"round expects {len(previous)} member(s) to re-join, {newcomers} newcomer(s) wait",
        )
    )
    effects.extend(maybe_form(job, now))
    return effects


def lose_before_rejoining(job: Job, rnd: Round, member: Member, cause: str, now: float
                          ) -> list[Effect]:
    """A member of the ended generation is lost before it re-joined: the round no
    longer expects it (the caller may then form the next generation)."""
    member.state = MemberState.LOST
    member.cause = cause
    rnd.expected.discard(member.worker_id)
    record(job, now, "lost", member.cause, member)
    return [
        Log(
            logging.WARNING,
            f"job '{job.job_id}': {member.describe()} of ended generation "
            f"{job.generation} was lost before re-joining: {member.cause}",
        )
    ]


def check_round(
    job: Job, elastic: ElasticBounds, rnd: Round, now: float, lease_s: float
) -> list[Effect]:
    """An elastic round's deadlines: leases of members awaited, settling, elastic timeout.

    A member of the ended generation that has not re-joined within its lease is
    lost and no longer expected. A first round (or one whose newcomers were
    launched for a larger world) stops waiting for the launched world size
    once :data:`NEWCOMER_GATHER_LEASES` leases have passed without a worker
    arriving (and at least one lease after it opened). A round that still lacks min_size
    joiners ``elastic.timeout_s`` after it opened fails the job.
    """
    effects: list[Effect] = []
    for worker_id in sorted(rnd.expected - rnd.joiners.keys()):
        member = job.by_worker[worker_id]
        if not expired(member, now, lease_s):
            continue
        silent = now - member.last_heartbeat
        effects.extend(lose_before_rejoining(
            job, rnd, member, f"lease expired (no heartbeat for {silent:.1f} s)", now))
    waited = now - rnd.opened_at
    if rnd.wait_for and waited > lease_s:
        # Workers started together arrive over a while (each imports its
        # framework, on a machine that may be busy): keep waiting while they
        # still come.
        last = max((j.joined_at for j in rnd.joiners.values()), default=rnd.opened_at)
        if now - last > NEWCOMER_GATHER_LEASES * lease_s:
            rnd.wait_for = 0
    came = len(rnd.joiners)
    if came < elastic.min_size and waited > elastic.timeout_s:
        failure = (
            f"elastic job '{job.job_id}': only {came} worker(s) joined within "
            f"{elastic.timeout_s:g} s; at least {elastic.min_size} required (min_size)"
        )
        effects.append(Log(logging.ERROR, failure))
        effects.extend(fail_job(job, failure, now))
        return effects
    effects.extend(maybe_form(job, now))
    return effects
