"""Job state and its transitions: deciding, separate from doing.

Every operation on a job is a function here that takes the job, the request
and the current time, updates the job's dataclasses and returns a list of
*effects* (answer this joiner, send this message to these members, log this
line). Nothing in this module does I/O, sleeps or reads a clock; the
:class:`~hora_coordinator.coordinator.Coordinator` applies the effects. That
keeps every rule testable with a fake clock and no servers.

Lifecycle of a job::

    GATHERING --world gathers--> RUNNING --every member left--> FINISHED
                                    |                              |
                                    +--member lost / stall--> FAILED
    FINISHED --the next round gathers--> RUNNING (generation + 1)

An elastic job (``min_size >= 1``) does not fail when it loses a member: the
generation ends and the job goes back to GATHERING with a round that expects
the members that are still alive (they re-join after their reset) plus any
newcomer. A member that leaves with ``rejoin`` ends the generation the same
way, without being counted as lost::

    RUNNING --member lost / left with rejoin--> GATHERING (round expects the survivors)
    GATHERING --survivors re-joined, min_size..max_size there--> RUNNING (generation + 1)
    GATHERING --fewer than min_size after elastic_timeout--> FAILED

Lifecycle of a member: JOINING (in the next round) -> ACTIVE -> LEFT | LOST.
Between generations of an elastic job, the members of the ended generation
keep their lease (heartbeats renew it) until they re-join; one whose lease
runs out is LOST and no longer expected.

Every transition also appends to the job's event log (:class:`JobEvent`),
bounded to the last :data:`EVENT_LOG_LIMIT` entries.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections import deque
from dataclasses import dataclass, field

from hora_proto.placement import place
from hora_proto.v1 import negotiation_pb2 as npb
from hora_proto.v1 import rendezvous_pb2 as rpb

from .errors import (
    CoordinatorError,
    InvalidRequestError,
    JobFailedError,
    PreconditionError,
    RoundFullError,
    StaleGenerationError,
    UnknownError,
)
from .negotiation import NegotiationTable, format_ranks

__all__ = [
    "DEFAULT_ELASTIC_TIMEOUT_S",
    "EVENT_LOG_LIMIT",
    "Admit",
    "Effect",
    "ElasticConfig",
    "Job",
    "JobConfig",
    "JobEvent",
    "JobPhase",
    "Joiner",
    "Log",
    "LossDecision",
    "Member",
    "MemberState",
    "NewGeneration",
    "Reject",
    "Round",
    "Send",
    "add_process_set",
    "assign_ranks",
    "cancel_join",
    "check",
    "decide_after_loss",
    "elastic_order",
    "events_pb",
    "get_world",
    "handle_requests",
    "heartbeat",
    "join",
    "leave",
    "new_job",
    "open_stream",
    "remove_process_set",
    "report_event",
    "stream_closed",
    "world_view",
]

#: Events a job keeps; older ones are dropped first.
EVENT_LOG_LIMIT = 10_000
#: How long an elastic round waits for min_size workers when the first joiner
#: sent ``elastic_timeout_ms`` 0 (Horovod's default elastic timeout).
DEFAULT_ELASTIC_TIMEOUT_S = 600.0


class JobPhase(enum.Enum):
    """Where a job is in its life."""

    GATHERING = "gathering"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


class MemberState(enum.Enum):
    """Where a member is in its life."""

    JOINING = "joining"
    ACTIVE = "active"
    LEFT = "left"
    LOST = "lost"


_JOB_STATE_PB = {
    JobPhase.GATHERING: rpb.JOB_STATE_GATHERING,
    JobPhase.RUNNING: rpb.JOB_STATE_RUNNING,
    JobPhase.FINISHED: rpb.JOB_STATE_FINISHED,
    JobPhase.FAILED: rpb.JOB_STATE_FAILED,
}
_MEMBER_STATE_PB = {
    MemberState.JOINING: rpb.MEMBER_STATE_JOINING,
    MemberState.ACTIVE: rpb.MEMBER_STATE_ACTIVE,
    MemberState.LEFT: rpb.MEMBER_STATE_LEFT,
    MemberState.LOST: rpb.MEMBER_STATE_LOST,
}


@dataclass(frozen=True)
class JobConfig:
    """Settings every rank of a generation shares, taken from the round's first joiner."""

    size: int
    fusion_threshold_bytes: int = 0
    stall_warning_s: float = 0.0
    stall_shutdown_s: float = 0.0


@dataclass(frozen=True)
class ElasticConfig:
    """Bounds of an elastic job's world, fixed by the job's first joiner.

    Attributes:
        min_size: Fewest members a generation may have (>= 1).
        max_size: Most members a generation may have; 0 for no bound.
        timeout_s: How long a round may lack min_size joiners before the job fails.
    """

    min_size: int
    max_size: int
    timeout_s: float

    def clamp(self, size: int) -> int:
        """``size`` moved into [min_size, max_size]."""
        size = max(size, self.min_size)
        return min(size, self.max_size) if self.max_size else size

    def below_max(self, size: int) -> bool:
        """Whether a world of ``size`` may still grow."""
        return self.max_size == 0 or size < self.max_size


@dataclass(frozen=True)
class JobEvent:
    """One entry of a job's event log (what ``ListEvents`` and ``/events`` serve).

    ``rank`` is -1 and ``pid`` 0 where the event concerns no single member.
    """

    unix_ms: int
    kind: str
    generation: int
    rank: int = -1
    host: str = ""
    pid: int = 0
    message: str = ""


@dataclass
class Joiner:
    """A worker waiting in the next round."""

    worker_id: str
    host: str
    pid: int
    data_plane_address: str
    rank_hint: int
    arrival: int
    joined_at: float


@dataclass
class Round:
    """The next generation while it gathers."""

    config: JobConfig
    joiners: dict[str, Joiner] = field(default_factory=dict)
    hints: dict[int, str] = field(default_factory=dict)  # rank hint -> worker id
    # Elastic only. When the round began to count towards elastic_timeout.
    opened_at: float = 0.0
    # Members of the ended generation (worker id -> old rank) when this round
    # follows one; those still in `expected` must re-join (or be lost) first.
    previous: dict[str, int] = field(default_factory=dict)
    expected: set[str] = field(default_factory=set)
    # A first round waits for this many joiners (the launcher's world size)
    # for at most one lease, then forms with whoever came (at least min_size).
    wait_for: int = 0
    # True for the round that follows an ended generation (kept while empty).
    follows_generation: bool = False


@dataclass
class Member:
    """A member of the current generation."""

    rank: int
    worker_id: str
    host: str
    pid: int
    data_plane_address: str
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    last_heartbeat: float
    state: MemberState = MemberState.ACTIVE
    cause: str = ""
    # LEFT with rejoin: it left this generation only (an elastic reset).
    rejoin: bool = False

    def describe(self) -> str:
        """``rank R (host H, pid P)``, the way every message names a member."""
        return f"rank {self.rank} (host {self.host}, pid {self.pid})"


@dataclass
class Job:
    """One job: its current generation, the round gathering for the next, counters."""

    job_id: str
    created_at: float
    phase: JobPhase = JobPhase.GATHERING
    failure: str = ""
    generation: int = 0
    config: JobConfig | None = None
    members: list[Member] = field(default_factory=list)  # by rank
    by_worker: dict[str, Member] = field(default_factory=dict)
    is_homogeneous: bool = True
    round: Round | None = None
    table: NegotiationTable = field(default_factory=lambda: NegotiationTable(0, 0))
    arrivals: int = 0
    negotiated_tensors: int = 0
    errors: int = 0
    negotiation_messages: int = 0
    elastic: ElasticConfig | None = None
    reset_count: int = 0  # generations formed after the first (elastic resets)
    host_update_epoch: int = 0
    removals_only: bool = False
    events: deque[JobEvent] = field(default_factory=lambda: deque(maxlen=EVENT_LOG_LIMIT))

    @property
    def size(self) -> int:
        """Size of the current generation, else of the gathering round, else 0."""
        if self.config is not None:
            return self.config.size
        return self.round.config.size if self.round is not None else 0

    def active_worker_ids(self, exclude: str = "") -> tuple[str, ...]:
        """Worker ids of the ACTIVE members, by rank."""
        return tuple(
            m.worker_id
            for m in self.members
            if m.state is MemberState.ACTIVE and m.worker_id != exclude
        )


# ---- effects: what the coordinator must do after a transition --------------------------


@dataclass(frozen=True)
class NewGeneration:
    """A generation formed: open an outbox for each of these workers."""

    generation: int
    worker_ids: tuple[str, ...]


@dataclass(frozen=True)
class Admit:
    """Answer this worker's pending Join with its world view."""

    worker_id: str
    view: rpb.WorldView


@dataclass(frozen=True)
class Reject:
    """Answer this worker's pending Join with an error."""

    worker_id: str
    error: CoordinatorError


@dataclass(frozen=True)
class Send:
    """Queue one message on the negotiation stream of each of these workers."""

    worker_ids: tuple[str, ...]
    message: npb.CoordinatorMessage


@dataclass(frozen=True)
class Log:
    """Write one log line."""

    level: int
    message: str


Effect = NewGeneration | Admit | Reject | Send | Log


class LossDecision(enum.Enum):
    """What a job does when it loses a member."""

    FAIL_JOB = "fail job"
    NEW_GENERATION = "new generation"


# ---- rank assignment and topology ------------------------------------------------------


def assign_ranks(joiners: list[Joiner], size: int) -> list[Joiner]:
    """Orders joiners by rank: hints first, the rest fill free ranks by (host, arrival).

    Hints are assumed unique and in range (:func:`join` checks both).
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


def world_view(job: Job, member: Member, template: rpb.WorldView | None = None) -> rpb.WorldView:
    """The world as ``member`` sees it.

    Args:
        template: A view of the same job state from :func:`_view_template`;
            copying it (in C) beats rebuilding the member list per member when
            a whole world is admitted at once.
    """
    view = rpb.WorldView()
    view.CopyFrom(template if template is not None else _view_template(job))
    view.rank = member.rank
    view.local_rank = member.local_rank
    view.local_size = member.local_size
    view.cross_rank = member.cross_rank
    view.cross_size = member.cross_size
    return view


def _view_template(job: Job) -> rpb.WorldView:
    return rpb.WorldView(
        job_id=job.job_id,
        generation=job.generation,
        size=len(job.members),
        is_homogeneous=job.is_homogeneous,
        members=[_member_pb(m) for m in job.members],
        store_prefix=f"{job.job_id}/gen-{job.generation}/",
    )


def _member_pb(m: Member) -> rpb.Member:
    return rpb.Member(
        rank=m.rank,
        worker_id=m.worker_id,
        host=m.host,
        pid=m.pid,
        state=_MEMBER_STATE_PB[m.state],
        data_plane_address=m.data_plane_address,
        local_rank=m.local_rank,
        last_heartbeat_unix_ms=int(m.last_heartbeat * 1000),
    )


# ---- transitions ----------------------------------------------------------------------


def new_job(job_id: str, now: float) -> Job:
    """A job nobody has joined yet."""
    return Job(job_id=job_id, created_at=now)


def _record(
    job: Job,
    now: float,
    kind: str,
    message: str = "",
    member: Member | Joiner | None = None,
    rank: int = -1,
) -> None:
    """Appends one event to the job's log (the deque drops the oldest past the limit)."""
    host, pid = (member.host, member.pid) if member is not None else ("", 0)
    if isinstance(member, Member):
        rank = member.rank
    job.events.append(JobEvent(int(now * 1000), kind, job.generation, rank, host, pid, message))


def _elastic_of(job: Job, request: rpb.JoinRequest) -> ElasticConfig | None:
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
    return ElasticConfig(min_size, request.max_size, timeout_s or DEFAULT_ELASTIC_TIMEOUT_S)


def _round_config(request: rpb.JoinRequest, size: int) -> JobConfig:
    return JobConfig(
        size=size,
        fusion_threshold_bytes=max(0, request.fusion_threshold_bytes),
        stall_warning_s=max(0, request.stall_warning_ms) / 1000.0,
        stall_shutdown_s=max(0, request.stall_shutdown_ms) / 1000.0,
    )


def _joiner(job: Job, request: rpb.JoinRequest, now: float) -> Joiner:
    job.arrivals += 1
    return Joiner(
        worker_id=request.worker_id,
        host=request.host,
        pid=request.pid,
        data_plane_address=request.data_plane_address,
        rank_hint=request.rank_hint,
        arrival=job.arrivals,
        joined_at=now,
    )


def join(job: Job, request: rpb.JoinRequest, now: float) -> list[Effect]:
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
    elastic = _elastic_of(job, request)
    member = job.by_worker.get(request.worker_id)
    if member is not None and member.state is MemberState.ACTIVE and job.phase is JobPhase.RUNNING:
        # A retry after the answer got lost: same generation, same view.
        return [Admit(request.worker_id, world_view(job, member))]
    size = request.expected_size
    if size < 1:
        raise InvalidRequestError(f"expected_size must be at least 1, got {size}")
    if elastic is not None:
        job.elastic = elastic
        return _join_elastic(job, elastic, request, now)
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
        _drop_joiner(rnd, request.worker_id)  # a retry of a pending Join replaces it
    else:
        rnd = job.round = Round(_round_config(request, size))
    joiner = rnd.joiners[request.worker_id] = _joiner(job, request, now)
    if hint >= 0:
        rnd.hints[hint] = request.worker_id
    if not retry:
        _record(
            job,
            now,
            "join",
            f"worker {request.worker_id} joined ({len(rnd.joiners)} of {size})",
            joiner,
            rank=hint,
        )
    return _maybe_form(job, now)


def _join_elastic(
    job: Job, elastic: ElasticConfig, request: rpb.JoinRequest, now: float
) -> list[Effect]:
    """Join of an elastic job: rank hints only order newcomers; rounds are never full."""
    worker_id = request.worker_id
    if request.rank_hint < -1:
        raise InvalidRequestError(
            f"rank hint {request.rank_hint} must be -1 (any) or a rank, not negative"
        )
    rnd = job.round
    if rnd is None:
        rnd = job.round = Round(_round_config(request, request.expected_size), opened_at=now)
        if job.phase is not JobPhase.RUNNING:  # a first round: wait for the launched world
            rnd.wait_for = elastic.clamp(request.expected_size)
    retry = worker_id in rnd.joiners
    rnd.joiners.pop(worker_id, None)  # a retry of a pending Join replaces it
    joiner = rnd.joiners[worker_id] = _joiner(job, request, now)
    effects: list[Effect] = []
    if retry:
        return _maybe_form(job, now)
    old_rank = rnd.previous.get(worker_id)
    member = job.by_worker.get(worker_id)
    if old_rank is not None and member is not None and member.state is MemberState.ACTIVE:
        # Joining again is leaving the ended generation, even without Leave(rejoin).
        member.state, member.rejoin, member.cause = MemberState.LEFT, True, "reset"
    text = f"worker {worker_id} joined"
    if old_rank is not None:
        text += f" (rank {old_rank} of generation {job.generation})"
    _record(job, now, "join", text, joiner)
    if job.phase is JobPhase.RUNNING and elastic.below_max(len(job.members)):
        job.host_update_epoch += 1
        job.removals_only = False
        message = (
            f"worker {worker_id} (host {request.host}) waits to join running generation "
            f"{job.generation} of {len(job.members)} member(s); host update epoch "
            f"{job.host_update_epoch}"
        )
        _record(job, now, "join_waiting", message, joiner)
        effects.append(Log(logging.INFO, f"job '{job.job_id}': {message}"))
    effects.extend(_maybe_form(job, now))
    return effects


def _drop_joiner(rnd: Round, worker_id: str) -> None:
    joiner = rnd.joiners.pop(worker_id, None)
    if joiner is not None and joiner.rank_hint >= 0:
        rnd.hints.pop(joiner.rank_hint, None)


def cancel_join(job: Job, worker_id: str, now: float | None = None) -> list[Effect]:
    """A pending joiner's deadline passed: forget it (an empty round forgets its config).

    A member of an ended elastic generation stays expected: it may Join again
    within a lease, counted from ``now`` (its Join call was alive until then).
    """
    rnd = job.round
    if rnd is None or worker_id not in rnd.joiners:
        return []
    _drop_joiner(rnd, worker_id)
    member = job.by_worker.get(worker_id)
    if worker_id in rnd.expected and member is not None and now is not None:
        member.last_heartbeat = max(member.last_heartbeat, now)
    if not rnd.joiners and not rnd.follows_generation:
        job.round = None
    return [Log(logging.INFO, f"job '{job.job_id}': worker {worker_id} stopped waiting to join")]


def _maybe_form(job: Job, now: float) -> list[Effect]:
    rnd = job.round
    if rnd is None or job.phase is JobPhase.RUNNING:
        return []  # the round waits until the running generation is over
    if job.elastic is not None:
        if not rnd.joiners or not rnd.expected <= rnd.joiners.keys():
            return []  # members of the ended generation re-join (or are lost) first
        if len(rnd.joiners) < max(job.elastic.min_size, rnd.wait_for):
            return []
        return _form(job, rnd, now)
    if len(rnd.joiners) < rnd.config.size:
        return []
    return _form(job, rnd, now)


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


def _form(job: Job, rnd: Round, now: float) -> list[Effect]:
    later: list[Joiner] = []
    if job.elastic is not None:
        ordered, later = elastic_order(rnd, job.elastic.max_size)
    else:
        ordered = assign_ranks(list(rnd.joiners.values()), rnd.config.size)
    config = dataclasses.replace(rnd.config, size=len(ordered))
    kept = sum(1 for j in ordered if j.worker_id in rnd.previous)
    placements, homogeneous = place([j.host for j in ordered])
    job.generation += 1
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
    job.table = NegotiationTable(config.size, config.fusion_threshold_bytes)
    text = f"generation {job.generation} formed with {config.size} member(s)"
    if job.elastic is not None and job.generation > 1:
        job.reset_count += 1
        text += f" ({kept} kept, {config.size - kept} new; reset {job.reset_count})"
    if later:
        text += f"; {len(later)} worker(s) wait for a later round (max_size)"
    _record(job, now, "generation", text)
    effects: list[Effect] = [
        NewGeneration(job.generation, tuple(m.worker_id for m in job.members)),
        Log(logging.INFO, f"job '{job.job_id}': {text}"),
    ]
    template = _view_template(job)
    effects.extend(Admit(m.worker_id, world_view(job, m, template)) for m in job.members)
    return effects


def _end_generation(job: Job, now: float, why: str) -> list[Effect]:
    """An elastic generation is over: open the round that expects its survivors."""
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
    rnd.opened_at, rnd.wait_for, rnd.follows_generation = now, 0, True
    newcomers = len(rnd.joiners)
    effects: list[Effect] = [
        Log(
            logging.INFO,
            f"job '{job.job_id}': generation {job.generation} is over ({why}); the next "
            f"round expects {len(previous)} member(s) to re-join, {newcomers} newcomer(s) wait",
        )
    ]
    effects.extend(_maybe_form(job, now))
    return effects


def leave(job: Job, worker_id: str, reason: str, now: float, rejoin: bool = False) -> list[Effect]:
    """A worker leaves on purpose (idempotent).

    Pending tensors the leaver never submitted fail on the ranks that did; the
    others get MEMBER_LEFT. When the last member leaves the job is FINISHED and
    a complete waiting round forms the next generation.

    With ``rejoin`` (elastic jobs only; ignored otherwise) the member leaves
    this generation only: the generation is over, and the next round expects
    the leaver (and every other member still alive) to Join again.
    """
    rejoin = rejoin and job.elastic is not None
    rnd = job.round
    if rnd is not None and worker_id in rnd.joiners:
        effects = cancel_join(job, worker_id, now)
        effects.append(
            Reject(
                worker_id,
                PreconditionError(
                    f"worker {worker_id} left job '{job.job_id}' before the world gathered"
                ),
            )
        )
        if worker_id in rnd.expected and not rejoin:
            effects.extend(_leave_between(job, rnd, job.by_worker[worker_id], reason, False, now))
        return effects
    member = job.by_worker.get(worker_id)
    if member is None:
        return []
    if job.phase is JobPhase.GATHERING and rnd is not None and worker_id in rnd.expected:
        return _leave_between(job, rnd, member, reason, rejoin, now)
    if member.state is not MemberState.ACTIVE:
        return []
    rejoin = rejoin and job.phase is JobPhase.RUNNING
    member.state = MemberState.LEFT
    member.rejoin = rejoin
    member.cause = reason or ("reset" if rejoin else "left")
    _record(job, now, "reset" if rejoin else "left", member.cause, member)
    what = "left for an elastic reset" if rejoin else "left"
    effects: list[Effect] = [
        Log(
            logging.INFO,
            f"job '{job.job_id}' generation {job.generation}: "
            f"{member.describe()} {what} ({member.cause})",
        )
    ]
    if job.phase is not JobPhase.RUNNING:
        return effects
    gone = "left for an elastic reset" if rejoin else "has shut down"
    failed = job.table.depart(member.rank, f"{member.describe()} {gone}")
    effects.extend(_send_by_rank(job, failed))
    others = job.active_worker_ids()
    if others:
        effects.append(
            Send(others, _event(job, npb.EVENT_TYPE_MEMBER_LEFT, now, member, member.cause))
        )
    if rejoin:
        effects.extend(_end_generation(job, now, f"{member.describe()} left to re-join"))
        return effects
    if others:
        return effects
    job.phase = JobPhase.FINISHED
    job.table.clear()
    _record(job, now, "finished", f"every member of generation {job.generation} left")
    effects.append(Log(logging.INFO, f"job '{job.job_id}': generation {job.generation} finished"))
    effects.extend(_maybe_form(job, now))
    return effects


def _leave_between(
    job: Job, rnd: Round, member: Member, reason: str, rejoin: bool, now: float
) -> list[Effect]:
    """Leave of a member of an ended elastic generation that the next round expects."""
    effects: list[Effect] = []
    if rejoin:
        member.last_heartbeat = max(member.last_heartbeat, now)  # a fresh lease to re-join
        if member.state is MemberState.ACTIVE:
            member.state, member.rejoin, member.cause = MemberState.LEFT, True, reason or "reset"
            _record(job, now, "reset", member.cause, member)
        return effects
    member.state, member.rejoin, member.cause = MemberState.LEFT, False, reason or "left"
    rnd.expected.discard(member.worker_id)
    _record(job, now, "left", member.cause, member)
    effects.append(
        Log(
            logging.INFO,
            f"job '{job.job_id}': {member.describe()} of ended generation {job.generation} "
            f"left ({member.cause}); the next round no longer expects it",
        )
    )
    if not rnd.expected and not rnd.joiners:
        job.phase = JobPhase.FINISHED
        job.round = None
        _record(job, now, "finished", "every member left")
        effects.append(Log(logging.INFO, f"job '{job.job_id}': every member left; finished"))
        return effects
    effects.extend(_maybe_form(job, now))
    return effects


def heartbeat(job: Job, worker_id: str, now: float, lease_s: float) -> rpb.HeartbeatResponse:
    """Renews a member's lease and reports the job's generation and state.

    Renews ACTIVE members, and members of an ended elastic generation that the
    next round still expects (they are between Leave(rejoin) and Join).
    """
    member = job.by_worker.get(worker_id)
    if member is not None and (
        member.state is MemberState.ACTIVE
        or (job.round is not None and worker_id in job.round.expected)
    ):
        member.last_heartbeat = now
    return rpb.HeartbeatResponse(
        generation=job.generation,
        job_state=_JOB_STATE_PB[job.phase],
        lease_ms=int(lease_s * 1000),
        failure=job.failure,
        host_update_epoch=job.host_update_epoch,
        removals_only=job.removals_only,
    )


def report_event(job: Job, kind: str, host: str, message: str, now: float) -> None:
    """Records an event the launcher saw (a blacklisted host, a started worker, ...).

    Raises:
        InvalidRequestError: ``kind`` is empty.
    """
    if not kind:
        raise InvalidRequestError("an event needs a kind (e.g. 'blacklist')")
    job.events.append(JobEvent(int(now * 1000), kind, job.generation, -1, host, 0, message))


def events_pb(job: Job) -> list[rpb.JobEvent]:
    """The job's event log, oldest first, as protobuf messages."""
    return [rpb.JobEvent(**dataclasses.asdict(e)) for e in job.events]


def get_world(job: Job, worker_id: str) -> rpb.WorldView:
    """The current view of a member of the current generation.

    Raises:
        UnknownError: the worker is not a member of the current generation.
    """
    member = job.by_worker.get(worker_id)
    if member is None:
        raise UnknownError(
            f"worker {worker_id} is not a member of job '{job.job_id}' generation {job.generation}"
        )
    return world_view(job, member)


def open_stream(job: Job, worker_id: str, generation: int, now: float) -> Member:
    """Checks that a worker may open its negotiation stream for ``generation``.

    Raises:
        JobFailedError: the job failed.
        StaleGenerationError: ``generation`` is not the running one.
        PreconditionError: the worker is not an ACTIVE member.
    """
    member = _active_member(job, worker_id, generation)
    member.last_heartbeat = now
    return member


def _active_member(job: Job, worker_id: str, generation: int) -> Member:
    """The ACTIVE member ``worker_id`` of running generation ``generation``, or raises.

    Raises:
        JobFailedError: the job failed.
        StaleGenerationError: ``generation`` is not the running one.
        PreconditionError: the worker is not an ACTIVE member.
    """
    if job.phase is JobPhase.FAILED:
        raise JobFailedError(f"job '{job.job_id}' has failed: {job.failure}")
    if generation != job.generation or job.phase is not JobPhase.RUNNING:
        raise StaleGenerationError(
            f"generation {generation} of job '{job.job_id}' is not running (current generation "
            f"{job.generation}, state {job.phase.value})"
        )
    member = job.by_worker.get(worker_id)
    if member is None or member.state is not MemberState.ACTIVE:
        raise PreconditionError(
            f"worker {worker_id} is not an active member of job "
            f"'{job.job_id}' generation {generation}"
        )
    return member


def add_process_set(
    job: Job, worker_id: str, generation: int, process_set_id: int, ranks: list[int]
) -> list[Effect]:
    """Registers a process set of the caller's generation (every rank calls it; idempotent).

    Raises:
        InvalidRequestError: id 0, bad ranks, or the id is taken by other ranks.
        JobFailedError, StaleGenerationError, PreconditionError: the caller is
            not an ACTIVE member of the running generation ``generation``.
    """
    _active_member(job, worker_id, generation)
    if not job.table.add_process_set(process_set_id, ranks):
        return []
    return [
        Log(
            logging.INFO,
            f"job '{job.job_id}' generation {job.generation}: process set {process_set_id} "
            f"added with ranks {format_ranks(ranks)}",
        )
    ]


def remove_process_set(
    job: Job, worker_id: str, generation: int, process_set_id: int
) -> list[Effect]:
    """Removes a process set (idempotent); its pending tensors fail on their submitters.

    Raises:
        InvalidRequestError: ``process_set_id`` is 0.
        JobFailedError, StaleGenerationError, PreconditionError: the caller is
            not an ACTIVE member of the running generation ``generation``.
    """
    _active_member(job, worker_id, generation)
    if process_set_id not in job.table.process_sets and process_set_id != 0:
        return []
    failed = job.table.remove_process_set(process_set_id)
    effects: list[Effect] = [
        Log(
            logging.INFO,
            f"job '{job.job_id}' generation {job.generation}: process set {process_set_id} removed",
        )
    ]
    effects.extend(_send_by_rank(job, failed))
    return effects


def _send_by_rank(job: Job, responses_by_rank: dict[int, list[npb.Response]]) -> list[Effect]:
    """One Send per ACTIVE recipient rank; counts the responses as errors."""
    effects: list[Effect] = []
    for rank, responses in responses_by_rank.items():
        recipient = job.members[rank]
        if recipient.state is MemberState.ACTIVE:
            job.errors += len(responses)
            effects.append(
                Send(
                    (recipient.worker_id,),
                    npb.CoordinatorMessage(responses=npb.ResponseList(responses=responses)),
                )
            )
    return effects


def stream_closed(job: Job, worker_id: str, generation: int, now: float) -> list[Effect]:
    """A member's negotiation stream ended; without a prior Leave the member is lost."""
    if generation != job.generation or job.phase is not JobPhase.RUNNING:
        return []
    member = job.by_worker.get(worker_id)
    if member is None or member.state is not MemberState.ACTIVE:
        return []
    return _lose(job, member, "stream closed", now)


def decide_after_loss(job: Job, member: Member) -> LossDecision:
    """The one place that decides what losing a member means for the job.

    Non-elastic jobs fail; elastic jobs end the generation and open the next
    round (which fails the job later if it cannot gather min_size workers).
    """
    return LossDecision.FAIL_JOB if job.elastic is None else LossDecision.NEW_GENERATION


def _lose(job: Job, member: Member, cause: str, now: float) -> list[Effect]:
    member.state = MemberState.LOST
    member.cause = cause
    decision = decide_after_loss(job, member)
    failure = f"{member.describe()} was lost: {cause}"
    _record(job, now, "lost", cause, member)
    level = logging.ERROR if decision is LossDecision.FAIL_JOB else logging.WARNING
    effects: list[Effect] = [
        Log(level, f"job '{job.job_id}' generation {job.generation}: {failure}")
    ]
    others = job.active_worker_ids()
    if others:
        effects.append(Send(others, _event(job, npb.EVENT_TYPE_MEMBER_LOST, now, member, cause)))
    if decision is LossDecision.NEW_GENERATION:
        effects.extend(_end_generation(job, now, failure))
    else:
        effects.extend(_fail(job, failure, now))
    return effects


def _fail(job: Job, failure: str, now: float) -> list[Effect]:
    job.phase = JobPhase.FAILED
    job.failure = failure
    job.table.clear()
    _record(job, now, "failed", failure)
    effects: list[Effect] = []
    others = job.active_worker_ids()
    if others:
        effects.append(
            Send(
                others,
                _event(
                    job,
                    npb.EVENT_TYPE_JOB_FAILED,
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


def _event(
    job: Job, kind: int, now: float, member: Member | None, message: str
) -> npb.CoordinatorMessage:
    event = npb.Event(
        type=kind, generation=job.generation, rank=-1, message=message, unix_ms=int(now * 1000)
    )
    if member is not None:
        event.rank, event.host, event.pid = member.rank, member.host, member.pid
    return npb.CoordinatorMessage(event=event)


def handle_requests(
    job: Job, worker_id: str, generation: int, requests: npb.RequestList, now: float
) -> list[Effect]:
    """One RequestList from a member's stream: record it, answer what became ready.

    This is the hot path: it costs O(tensors in the message + ranks answered),
    times the number of joined ranks while some have joined; a join request
    itself costs O(pending tensors).
    """
    job.negotiation_messages += 1
    member = job.by_worker.get(worker_id)
    if (
        job.phase is not JobPhase.RUNNING
        or generation != job.generation
        or member is None
        or member.state is not MemberState.ACTIVE
    ):
        if not requests.requests:
            return []
        if job.phase is JobPhase.FAILED:
            why = f"job '{job.job_id}' has failed: {job.failure}"
        else:
            why = f"generation {generation} of job '{job.job_id}' is over"
        responses = [
            npb.Response(
                type=npb.RESPONSE_TYPE_ERROR,
                tensor_names=[r.name],
                process_set_id=r.process_set_id,
                error_message=f"tensor '{r.name}' cannot run: {why}",
                error_kind=npb.ERROR_KIND_RANK_GONE,
            )
            for r in requests.requests
        ]
        job.errors += len(responses)
        return [
            Send(
                (worker_id,),
                npb.CoordinatorMessage(responses=npb.ResponseList(responses=responses)),
            )
        ]
    member.last_heartbeat = now
    outcome = job.table.submit(member.rank, requests.requests, now)
    job.negotiated_tensors += outcome.negotiated
    job.errors += outcome.errors
    effects: list[Effect] = []
    if outcome.direct:
        effects.append(
            Send(
                (worker_id,),
                npb.CoordinatorMessage(responses=npb.ResponseList(responses=outcome.direct)),
            )
        )
    members = job.members
    for pset, response_list in outcome.broadcasts:
        recipients = tuple(
            members[r].worker_id for r in pset.ranks if members[r].state is MemberState.ACTIVE
        )
        effects.append(Send(recipients, npb.CoordinatorMessage(responses=response_list)))
    for rank, responses in outcome.targeted.items():
        if members[rank].state is MemberState.ACTIVE:
            effects.append(
                Send(
                    (members[rank].worker_id,),
                    npb.CoordinatorMessage(responses=npb.ResponseList(responses=responses)),
                )
            )
    return effects


def check(job: Job, now: float, lease_s: float) -> list[Effect]:
    """The periodic check: expired leases, then stalled tensors; elastic rounds' deadlines."""
    if job.phase is not JobPhase.RUNNING and job.elastic is not None and job.round is not None:
        return _check_round(job, job.elastic, job.round, now, lease_s)
    if job.phase is not JobPhase.RUNNING:
        return []
    effects: list[Effect] = []
    for member in job.members:
        if member.state is MemberState.ACTIVE and now - member.last_heartbeat > lease_s:
            silent = now - member.last_heartbeat
            effects.extend(
                _lose(job, member, f"lease expired (no heartbeat for {silent:.1f} s)", now)
            )
            if job.phase is not JobPhase.RUNNING:
                return effects
    config = job.config
    if config is None or (config.stall_warning_s <= 0 and config.stall_shutdown_s <= 0):
        return effects
    warn_s, shutdown_s = config.stall_warning_s, config.stall_shutdown_s
    for tensor in list(job.table.pending.values()):
        waited = now - tensor.first_seen
        if shutdown_s > 0 and waited > shutdown_s:
            missing = format_ranks(job.table.missing_ranks(tensor))
            failure = (
                f"tensor '{tensor.name}' stalled for {waited:.1f} s; missing ranks: "
                f"{missing} (stall shutdown time {shutdown_s:g} s)"
            )
            effects.append(Log(logging.ERROR, f"job '{job.job_id}': {failure}"))
            effects.extend(_fail(job, failure, now))
            return effects
        if warn_s <= 0 or waited <= warn_s:
            continue
        if tensor.last_warned is not None and now - tensor.last_warned < warn_s:
            continue
        tensor.last_warned = now
        missing_ranks = job.table.missing_ranks(tensor)
        text = (
            f"tensor '{tensor.name}' has waited {waited:.1f} s; missing ranks: "
            f"{format_ranks(missing_ranks)}"
        )
        effects.append(
            Log(logging.WARNING, f"job '{job.job_id}' generation {job.generation}: {text}")
        )
        message = _event(job, npb.EVENT_TYPE_STALL_WARNING, now, None, text)
        message.event.tensor_names.append(tensor.name)
        message.event.missing_ranks.extend(missing_ranks)
        submitters = tuple(
            job.members[r].worker_id
            for r in sorted(tensor.submissions)
            if job.members[r].state is MemberState.ACTIVE
        )
        effects.append(Send(submitters, message))
    return effects


def _check_round(
    job: Job, elastic: ElasticConfig, rnd: Round, now: float, lease_s: float
) -> list[Effect]:
    """An elastic round's deadlines: leases of members awaited, settling, elastic timeout.

    A member of the ended generation that has not re-joined within its lease is
    lost and no longer expected. A first round stops waiting for the launched
    world size one lease after it opened. A round that still lacks min_size
    joiners ``elastic.timeout_s`` after it opened fails the job.
    """
    effects: list[Effect] = []
    for worker_id in sorted(rnd.expected - rnd.joiners.keys()):
        member = job.by_worker[worker_id]
        silent = now - member.last_heartbeat
        if silent <= lease_s:
            continue
        member.state = MemberState.LOST
        member.cause = f"lease expired (no heartbeat for {silent:.1f} s)"
        rnd.expected.discard(worker_id)
        _record(job, now, "lost", member.cause, member)
        effects.append(
            Log(
                logging.WARNING,
                f"job '{job.job_id}': {member.describe()} of ended generation "
                f"{job.generation} was lost before re-joining: {member.cause}",
            )
        )
    waited = now - rnd.opened_at
    if rnd.wait_for and waited > lease_s:
        rnd.wait_for = 0
    came = len(rnd.joiners)
    if came < elastic.min_size and waited > elastic.timeout_s:
        failure = (
            f"elastic job '{job.job_id}': only {came} worker(s) joined within "
            f"{elastic.timeout_s:g} s; at least {elastic.min_size} required (min_size)"
        )
        effects.append(Log(logging.ERROR, failure))
        effects.extend(_fail(job, failure, now))
        return effects
    effects.extend(_maybe_form(job, now))
    return effects
