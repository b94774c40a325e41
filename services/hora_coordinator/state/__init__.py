"""Job state and its transitions: deciding, separate from doing.

Every operation on a job is a function here that takes the job, the request
and the current time, updates the job's dataclasses and returns a list of
*effects* (answer this joiner, send this message to these members, log this
line). Nothing in this package does I/O, sleeps or reads a clock; the
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
bounded to the last ``max_events_per_job`` entries (:data:`EVENT_LOG_LIMIT` by
default); the job counts the ones it dropped.

The package's modules, one per stage: :mod:`.job` (the records),
:mod:`.effects` (what a transition asks the coordinator to do),
:mod:`.rendezvous` (Join), :mod:`.generations` (forming a generation, failing a
job), :mod:`.elastic` (elastic bounds, ends of generations, round deadlines),
:mod:`.departures` (Leave and losses), :mod:`.liveness` (heartbeats, the
periodic check), :mod:`.leases` (heartbeat intervals and leases sized to the
load), :mod:`.restore` (members re-attaching after a coordinator restart or
outage), :mod:`.streams` (negotiation streams), :mod:`.process_sets`
(AddProcessSet and RemoveProcessSet, collectives of every member) and
:mod:`.views` (world views, heartbeat replies, the event log). The transitions
take and return plain objects (:mod:`hora_coordinator.messages`, :mod:`.views`);
:mod:`hora_coordinator.wire` converts them to and from protobuf.
"""

from __future__ import annotations

from .departures import LossDecision, decide_after_loss, leave, stream_closed
from .effects import Admit, Answer, Effect, Log, NewGeneration, Reject, Send
from .elastic import NEWCOMER_GATHER_LEASES
from .generations import elastic_order, order_joiners
from .job import (
    DEFAULT_ELASTIC_TIMEOUT_S,
    EVENT_LOG_LIMIT,
    TEXT_LIMIT,
    ElasticBounds,
    Job,
    JobConfig,
    JobEvent,
    JobPhase,
    Joiner,
    Member,
    MemberState,
    Round,
    new_job,
)
from .leases import Lease, LeasePolicy, heartbeating_members, plan_leases
from .liveness import check, forgive_stall, heartbeat
from .process_sets import (
    add_process_set,
    call_add_process_set,
    call_remove_process_set,
    remove_process_set,
    withdraw_set_call,
)
from .rendezvous import abandoned, cancel_join, join
from .restore import reattach, restore_job
from .streams import handle_requests, open_stream, redeliver
from .telemetry import RankTelemetry, Sample, StragglerSummary, is_straggler, job_rates, stragglers
from .views import (
    HeartbeatReply,
    StreamHeartbeatAnswer,
    WorldMember,
    WorldView,
    active_telemetry,
    event_log,
    get_world,
    report_event,
    sample_job,
    world_view,
)

__all__ = [
    "NEWCOMER_GATHER_LEASES",
    "DEFAULT_ELASTIC_TIMEOUT_S",
    "EVENT_LOG_LIMIT",
    "TEXT_LIMIT",
    "Admit",
    "Answer",
    "Effect",
    "ElasticBounds",
    "HeartbeatReply",
    "Job",
    "JobConfig",
    "JobEvent",
    "JobPhase",
    "Joiner",
    "Lease",
    "LeasePolicy",
    "Log",
    "LossDecision",
    "Member",
    "MemberState",
    "RankTelemetry",
    "Sample",
    "StragglerSummary",
    "NewGeneration",
    "Reject",
    "Round",
    "Send",
    "StreamHeartbeatAnswer",
    "WorldMember",
    "WorldView",
    "abandoned",
    "active_telemetry",
    "add_process_set",
    "call_add_process_set",
    "call_remove_process_set",
    "cancel_join",
    "check",
    "decide_after_loss",
    "elastic_order",
    "event_log",
    "forgive_stall",
    "get_world",
    "handle_requests",
    "heartbeat",
    "heartbeating_members",
    "is_straggler",
    "job_rates",
    "join",
    "leave",
    "new_job",
    "open_stream",
    "redeliver",
    "order_joiners",
    "plan_leases",
    "reattach",
    "remove_process_set",
    "report_event",
    "restore_job",
    "sample_job",
    "stream_closed",
    "stragglers",
    "withdraw_set_call",
    "world_view",
]
