"""A job's records: its phase, members, the round gathering the next generation."""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from dataclasses import dataclass, field

from hora_negotiation import NegotiationTable
from hora_proto.options import BY_FIELD

from ..messages import JoinRequest
from .telemetry import RankTelemetry, Series

__all__ = [
    "DEFAULT_ELASTIC_TIMEOUT_S",
    "EVENT_LOG_LIMIT",
    "TEXT_LIMIT",
    "ElasticBounds",
    "Job",
    "JobConfig",
    "JobEvent",
    "JobPhase",
    "Joiner",
    "Member",
    "MemberState",
    "Round",
    "kept_text",
    "new_job",
    "new_joiner",
    "record",
    "record_event",
    "round_config",
]


#: Events a job keeps by default (settings ``max_events_per_job``); older ones
#: are dropped first.
EVENT_LOG_LIMIT = 10_000
#: Most characters of free text a job keeps from a request (an event's
#: message, a Leave's reason); more is cut ("…"). With the events kept per job
#: bounded too, so is the memory its log takes.
TEXT_LIMIT = 1024
#: How long an elastic round waits for min_size workers when the first joiner
#: sent ``elastic_timeout_ms`` 0: the option's default (Horovod's elastic timeout).
DEFAULT_ELASTIC_TIMEOUT_S: float = BY_FIELD["elastic_timeout"].default.total_seconds()


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


@dataclass(frozen=True)
class JobConfig:
    """Settings every rank of a generation shares, taken from the round's first joiner."""

    size: int
    fusion_threshold_bytes: int = 0
    stall_warning_s: float = 0.0
    stall_shutdown_s: float = 0.0
    # The joiner's job-level options as it sent them (hora_proto.options), for
    # the REST view; the fields above are what the coordinator acts on.
    job_options: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ElasticBounds:
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
    # A first round (or one whose newcomers were launched for a larger world)
    # waits for this many joiners (the launcher's world size) while they
    # still arrive (see elastic.check_round), then forms with whoever came
    # (at least min_size).
    wait_for: int = 0
    # Elastic only: the largest world size the newcomers of this round were
    # launched for (their expected_size); the round that follows a generation
    # waits for it as the first round waits for the launched size.
    launched: int = 0
    # Elastic only, while a generation runs: since when newcomers here wait
    # for others launched with them before the running generation is told
    # (None: told already, or nobody waits).
    gathering_since: float | None = None
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
    # The lease its last heartbeat answer granted (0: none yet); it is judged on
    # the longer of this and the job's current lease (see .leases).
    lease_s: float = 0.0
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
    elastic: ElasticBounds | None = None
    reset_count: int = 0  # generations formed after the first (elastic resets)
    host_update_epoch: int = 0
    # host_update_epoch when the current generation formed (its world views carry it):
    # a member told of a newer epoch knows a newcomer waits, however soon it came.
    generation_host_epoch: int = 0
    removals_only: bool = False
    events: deque[JobEvent] = field(default_factory=lambda: deque(maxlen=EVENT_LOG_LIMIT))
    # Events ever recorded (the deque keeps the newest); the journal writes the rest.
    event_count: int = 0
    # Rebuilt from members' reports after a coordinator restart without a
    # journal: the event log starts again there.
    history_restarted: bool = False
    # Events the bounded log dropped (the oldest first) to keep its length.
    events_dropped: int = 0
    # By worker id: the telemetry its newest heartbeat carried (members of
    # this generation only; see .telemetry).
    telemetry: dict[str, RankTelemetry] = field(default_factory=dict)
    # Samples once a second while running, and generation marks.
    series: Series = field(default_factory=Series)

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


def new_job(job_id: str, now: float, max_events: int = EVENT_LOG_LIMIT) -> Job:
    """A job nobody has joined yet, whose log keeps the last ``max_events`` events."""
    return Job(job_id=job_id, created_at=now, events=deque(maxlen=max_events))


def kept_text(text: str) -> str:
    """``text`` as a job keeps it: at most :data:`TEXT_LIMIT` characters ("…" if cut)."""
    return text if len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + "…"


def record_event(job: Job, event: JobEvent) -> None:
    """Appends ``event`` to the job's log, its message cut to :data:`TEXT_LIMIT`;
    past the log's bound the oldest event goes, and is counted."""
    if len(event.message) > TEXT_LIMIT:
        event = dataclasses.replace(event, message=kept_text(event.message))
    if len(job.events) == job.events.maxlen:
        job.events_dropped += 1
    job.events.append(event)
    job.event_count += 1


def record(
    job: Job,
    now: float,
    kind: str,
    message: str = "",
    member: Member | Joiner | None = None,
    rank: int = -1,
    host: str = "",
) -> None:
    """Appends one event to the job's log (:func:`record_event`)."""
    host, pid = (member.host, member.pid) if member is not None else (host, 0)
    if isinstance(member, Member):
        rank = member.rank
    record_event(job, JobEvent(int(now * 1000), kind, job.generation, rank, host, pid, message))


def round_config(request: JoinRequest, size: int) -> JobConfig:
    """The settings a round takes from the Join that opens it."""
    return JobConfig(
        size=size,
        fusion_threshold_bytes=max(0, request.fusion_threshold_bytes),
        stall_warning_s=max(0, request.stall_warning_ms) / 1000.0,
        stall_shutdown_s=max(0, request.stall_shutdown_ms) / 1000.0,
        job_options=dict(request.job_options),
    )


def new_joiner(job: Job, request: JoinRequest, now: float) -> Joiner:
    """A joiner for ``request``, numbered by the job's arrival count."""
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
