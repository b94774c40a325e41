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

Lifecycle of a member: JOINING (in the next round) -> ACTIVE -> LEFT | LOST.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

from hora.v1 import negotiation_pb2 as npb
from hora.v1 import rendezvous_pb2 as rpb

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
    "Admit",
    "Effect",
    "Job",
    "JobConfig",
    "JobPhase",
    "Joiner",
    "Log",
    "LossDecision",
    "Member",
    "MemberState",
    "NewGeneration",
    "Placement",
    "Reject",
    "Round",
    "Send",
    "add_process_set",
    "assign_ranks",
    "cancel_join",
    "check",
    "decide_after_loss",
    "get_world",
    "handle_requests",
    "heartbeat",
    "join",
    "leave",
    "new_job",
    "open_stream",
    "place",
    "remove_process_set",
    "stream_closed",
    "world_view",
]


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
    # An elastic job will choose NEW_GENERATION here.


# ---- rank assignment and topology ------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where a rank sits among the hosts."""

    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


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


def place(hosts: list[str]) -> tuple[list[Placement], bool]:
    """Local and cross ranks for ranks whose hosts are ``hosts[rank]``.

    local_rank is the index among the same host's ranks; cross_rank the index
    of the host among hosts that have that local_rank, hosts ordered by their
    lowest rank.

    Returns:
        One placement per rank, and whether every host has the same number of ranks.
    """
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)  # insertion order = lowest rank first
    # hosts_with[lr] = hosts having a rank with local_rank lr, in host order.
    hosts_with: list[list[str]] = []
    for host, ranks in by_host.items():
        for local_rank in range(len(ranks)):
            if local_rank == len(hosts_with):
                hosts_with.append([])
            hosts_with[local_rank].append(host)
    cross_index = [{host: i for i, host in enumerate(hs)} for hs in hosts_with]
    placements = []
    local_index = {host: 0 for host in by_host}
    for host in hosts:
        local_rank = local_index[host]
        local_index[host] += 1
        placements.append(
            Placement(
                local_rank,
                len(by_host[host]),
                cross_index[local_rank][host],
                len(hosts_with[local_rank]),
            )
        )
    homogeneous = len({len(ranks) for ranks in by_host.values()}) <= 1
    return placements, homogeneous


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


def join(job: Job, request: rpb.JoinRequest, now: float) -> list[Effect]:
    """A worker asks to join the next generation.

    Returns:
        Admit effects for every joiner once the round is complete and no
        generation is running; else nothing (the joiner waits).

    Raises:
        InvalidRequestError: size contradicts the round's, hint out of range
            or taken, empty ids, or the round is full.
        JobFailedError: the job has failed.
    """
    if not request.worker_id:
        raise InvalidRequestError("worker_id must not be empty")
    if job.phase is JobPhase.FAILED:
        raise JobFailedError(f"job '{job.job_id}' has failed: {job.failure}")
    member = job.by_worker.get(request.worker_id)
    if member is not None and member.state is MemberState.ACTIVE:
        # A retry after the answer got lost: same generation, same view.
        return [Admit(request.worker_id, world_view(job, member))]
    size = request.expected_size
    if size < 1:
        raise InvalidRequestError(f"expected_size must be at least 1, got {size}")
    rnd = job.round
    if rnd is not None and rnd.config.size != size:
        raise InvalidRequestError(
            f"job '{job.job_id}' gathers a world of size {rnd.config.size} (set by its first "
            f"joiner), but worker {request.worker_id} expects size {size}"
        )
    hint = request.rank_hint
    if not -1 <= hint < size:
        raise InvalidRequestError(f"rank hint {hint} is outside [0, {size}) (or -1 for any)")
    if rnd is not None:
        holder = rnd.hints.get(hint) if hint >= 0 else None
        if holder is not None and holder != request.worker_id:
            other = rnd.joiners[holder]
            raise InvalidRequestError(
                f"rank hint {hint} is already taken by worker {holder} "
                f"(host {other.host}, pid {other.pid})"
            )
        others = len(rnd.joiners) - (request.worker_id in rnd.joiners)
        if others >= size:
            raise RoundFullError(
                f"job '{job.job_id}' already has {size} joiners for its next generation"
            )
        _drop_joiner(rnd, request.worker_id)  # a retry of a pending Join replaces it
    else:
        rnd = job.round = Round(
            JobConfig(
                size=size,
                fusion_threshold_bytes=max(0, request.fusion_threshold_bytes),
                stall_warning_s=max(0, request.stall_warning_ms) / 1000.0,
                stall_shutdown_s=max(0, request.stall_shutdown_ms) / 1000.0,
            )
        )
    job.arrivals += 1
    rnd.joiners[request.worker_id] = Joiner(
        worker_id=request.worker_id,
        host=request.host,
        pid=request.pid,
        data_plane_address=request.data_plane_address,
        rank_hint=hint,
        arrival=job.arrivals,
        joined_at=now,
    )
    if hint >= 0:
        rnd.hints[hint] = request.worker_id
    return _maybe_form(job, now)


def _drop_joiner(rnd: Round, worker_id: str) -> None:
    joiner = rnd.joiners.pop(worker_id, None)
    if joiner is not None and joiner.rank_hint >= 0:
        rnd.hints.pop(joiner.rank_hint, None)


def cancel_join(job: Job, worker_id: str) -> list[Effect]:
    """A pending joiner's deadline passed: forget it (an empty round forgets its config)."""
    rnd = job.round
    if rnd is None or worker_id not in rnd.joiners:
        return []
    _drop_joiner(rnd, worker_id)
    if not rnd.joiners:
        job.round = None
    return [Log(logging.INFO, f"job '{job.job_id}': worker {worker_id} stopped waiting to join")]


def _maybe_form(job: Job, now: float) -> list[Effect]:
    rnd = job.round
    if rnd is None or len(rnd.joiners) < rnd.config.size:
        return []
    if job.phase is JobPhase.RUNNING:
        return []  # the round waits until every member of the running generation has left
    return _form(job, rnd, now)


def _form(job: Job, rnd: Round, now: float) -> list[Effect]:
    config = rnd.config
    ordered = assign_ranks(list(rnd.joiners.values()), config.size)
    placements, homogeneous = place([j.host for j in ordered])
    job.generation += 1
    job.config = config
    job.round = None
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
    effects: list[Effect] = [
        NewGeneration(job.generation, tuple(m.worker_id for m in job.members)),
        Log(
            logging.INFO,
            f"job '{job.job_id}': generation {job.generation} formed with {config.size} member(s)",
        ),
    ]
    template = _view_template(job)
    effects.extend(Admit(m.worker_id, world_view(job, m, template)) for m in job.members)
    return effects


def leave(job: Job, worker_id: str, reason: str, now: float) -> list[Effect]:
    """A worker leaves on purpose (idempotent).

    Pending tensors the leaver never submitted fail on the ranks that did; the
    others get MEMBER_LEFT. When the last member leaves the job is FINISHED and
    a complete waiting round forms the next generation.
    """
    rnd = job.round
    if rnd is not None and worker_id in rnd.joiners:
        effects = cancel_join(job, worker_id)
        effects.append(
            Reject(
                worker_id,
                PreconditionError(
                    f"worker {worker_id} left job '{job.job_id}' before the world gathered"
                ),
            )
        )
        return effects
    member = job.by_worker.get(worker_id)
    if member is None or member.state is not MemberState.ACTIVE:
        return []
    member.state = MemberState.LEFT
    member.cause = reason or "left"
    effects: list[Effect] = [
        Log(
            logging.INFO,
            f"job '{job.job_id}' generation {job.generation}: "
            f"{member.describe()} left ({member.cause})",
        )
    ]
    if job.phase is not JobPhase.RUNNING:
        return effects
    failed = job.table.depart(member.rank, f"{member.describe()} has shut down")
    effects.extend(_send_by_rank(job, failed))
    others = job.active_worker_ids()
    if others:
        effects.append(
            Send(others, _event(job, npb.EVENT_TYPE_MEMBER_LEFT, now, member, member.cause))
        )
        return effects
    job.phase = JobPhase.FINISHED
    job.table.clear()
    effects.append(Log(logging.INFO, f"job '{job.job_id}': generation {job.generation} finished"))
    effects.extend(_maybe_form(job, now))
    return effects


def heartbeat(job: Job, worker_id: str, now: float, lease_s: float) -> rpb.HeartbeatResponse:
    """Renews an ACTIVE member's lease and reports the job's generation and state."""
    member = job.by_worker.get(worker_id)
    if member is not None and member.state is MemberState.ACTIVE:
        member.last_heartbeat = now
    return rpb.HeartbeatResponse(
        generation=job.generation,
        job_state=_JOB_STATE_PB[job.phase],
        lease_ms=int(lease_s * 1000),
        failure=job.failure,
    )


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

    Non-elastic jobs fail; an elastic mode will return a new generation here.
    """
    return LossDecision.FAIL_JOB


def _lose(job: Job, member: Member, cause: str, now: float) -> list[Effect]:
    member.state = MemberState.LOST
    member.cause = cause
    # Only FAIL_JOB exists so far; an elastic decision will branch here.
    decide_after_loss(job, member)
    failure = f"{member.describe()} was lost: {cause}"
    effects: list[Effect] = [
        Log(logging.ERROR, f"job '{job.job_id}' generation {job.generation}: {failure}")
    ]
    others = job.active_worker_ids()
    if others:
        effects.append(Send(others, _event(job, npb.EVENT_TYPE_MEMBER_LOST, now, member, cause)))
    effects.extend(_fail(job, failure, now))
    return effects


def _fail(job: Job, failure: str, now: float) -> list[Effect]:
    job.phase = JobPhase.FAILED
    job.failure = failure
    job.table.clear()
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
    """The periodic check: expired leases, then stalled tensors."""
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
