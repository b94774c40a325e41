"""The coordinator: owns the jobs and applies what the transitions decide.

:mod:`.state` decides; this module does: it resolves waiting Joins and
process set calls, queues messages on members' negotiation streams, writes
log lines, and runs the periodic lease and stall check. What it delivers to a
waiting transport (a Join's world view, a stream message) it encodes with
:mod:`.wire` once, for every recipient; its other methods take and return
domain objects, which the servicer converts with :mod:`.wire` too. Everything
here runs on one asyncio event loop, so the state needs no locks; the HTTP
routes read it on the same loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence

from hora_proto.v1 import rendezvous_pb2 as rpb

from . import state, wire
from .errors import (
    AlreadyOpenError,
    InvalidRequestError,
    ResourceExhaustedError,
    UnknownJobError,
)
from .journal import NO_JOURNAL, Journal
from .limits import check_event_limits, check_join_limits, shown_id, split_long_tensor_names
from .messages import (
    CoordinatorMessage,
    JoinRequest,
    ReattachRequest,
    ReceivedLists,
    ResponseList,
    TensorRequest,
)
from .notices import DepartureNotices, is_departure
from .outbox import STREAM_END, Outbox
from .periodic import PeriodicChecks
from .runtime import JobRuntime, Jobs, fingerprint, new_waiter
from .set_calls import ProcessSetCalls
from .settings import CoordinatorSettings
from .store import KeyValueStore

__all__ = ["Coordinator", "Outbox", "STREAM_END"]

logger = logging.getLogger("hora_coordinator")

#: Least time members of a job restored after a coordinator restart have to
#: re-attach before they are lost (seconds).
REATTACH_WINDOW_S = 10.0
# Put on an outbox to end the stream that drains it.


class Coordinator(PeriodicChecks, ProcessSetCalls):
    """Every job this process serves, and the effects of their transitions.

    Args:
        settings: The coordinator's settings (lease, check interval).
        clock: Unix time in seconds; injectable so tests can drive time.
        journal: Where jobs, events and store keys are written before they are
            acknowledged; what it holds is loaded now (a restart resumes it).
    """

    def __init__(
        self,
        settings: CoordinatorSettings,
        clock: Callable[[], float] = time.time,
        journal: Journal = NO_JOURNAL,
    ) -> None:
        self.settings, self.clock, self._box_limit = settings, clock, settings.max_stream_queue
        self.journal = journal
        # Everything held for each job, by id (forgetting a job deletes its runtime).
        self.runtimes: dict[str, JobRuntime] = {}
        self.jobs = Jobs(self.runtimes, self._new_store)
        self.serving = False
        self.closing = False
        self.lease_policy = state.LeasePolicy(
            shortest_lease_s=settings.lease.total_seconds(),
            shortest_interval_s=settings.heartbeat_interval.total_seconds(),
            heartbeats_per_s=settings.heartbeat_budget,
        )
        # How long the coordinator lately took to take a call of its own (see
        # measure_backlog): heartbeats wait that long before it can read them.
        self._backlog_s = 0.0
        self._probe_started: float | None = None
        self._notices = DepartureNotices()
        self._restore()

    def _restore(self) -> None:
        """Loads what the journal kept; running members get one lease to re-attach."""
        restored = self.journal.load(self.clock(), self.settings.max_events_per_job)
        for job in restored.jobs:
            if state.abandoned(job):
                self.journal.forget(job.job_id)
                continue
            self.runtimes[job.job_id] = JobRuntime(
                job, self._new_store(job.job_id, restored.stores.get(job.job_id)),
                journaled=fingerprint(job))
            self._await_reattach(job)
            if job.phase is state.JobPhase.RUNNING:
                logger.info("job '%s': generation %d restored from the journal; its %d "
                            "member(s) must re-attach within %g s", shown_id(job.job_id),
                            job.generation, len(job.active_worker_ids()),
                            self._reattach_window_s(job))
        if restored.jobs:
            logger.info("hora-coordinator: %d job(s) restored from the journal", len(self.jobs))

    def _reattach_window_s(self, job: state.Job) -> float:
        """How long members of a job restored after a restart have to re-attach: a
        lease, and at least :data:`REATTACH_WINDOW_S` (they find the new coordinator
        by reconnecting with backoff, which a short lease would not wait for)."""
        return max(self.lease_of(job).lease_s, REATTACH_WINDOW_S)

    def _await_reattach(self, job: state.Job) -> None:
        """Gives every member of a restored job the re-attach window from now."""
        lease_s = self.lease_of(job).lease_s
        until = self.clock() + self._reattach_window_s(job) - lease_s
        for member in job.members:
            member.last_heartbeat = max(member.last_heartbeat, until)

    def _persist(self, job: state.Job) -> None:
        """Writes the job to the journal when a transition changed what it keeps."""
        runtime = self.runtimes.get(job.job_id)
        if self.journal is NO_JOURNAL or runtime is None or runtime.job is not job:
            return
        seen = fingerprint(job)
        before = runtime.journaled
        if seen == before:
            return
        written = before[0] if before is not None else 0
        fresh = min(job.event_count - written, len(job.events))
        new_events = list(job.events)[len(job.events) - fresh:] if fresh > 0 else []
        self.journal.save_job(job, new_events)
        runtime.journaled = seen

    # ---- lookups ----------------------------------------------------------------------

    def job(self, job_id: str) -> state.Job:
        """The job named ``job_id``.

        Raises:
            UnknownJobError: no Join has named it yet.
        """
        job = self.jobs.get(job_id)
        if job is None:
            raise UnknownJobError(
                f"unknown job '{shown_id(job_id)}' (a job exists once a worker joins it)"
            )
        return job

    def _new_store(self, job_id: str, data: dict[str, bytes] | None = None) -> KeyValueStore:
        journal = self.journal
        return KeyValueStore(
            job_id,
            self.settings.max_store_key_bytes,
            self.settings.max_store_value_bytes,
            on_change=None if journal is NO_JOURNAL
            else lambda key, value: journal.store_write(job_id, key, value),
            data=data, max_keys=self.settings.max_store_keys_per_job,
            max_bytes=self.settings.max_store_bytes_per_job,
        )

    def runtime(self, job_id: str) -> JobRuntime:
        """What is held for job ``job_id``; raises UnknownJobError for an unknown job."""
        self.job(job_id)
        return self.runtimes[job_id]

    def store(self, job_id: str) -> KeyValueStore:
        """The store of job ``job_id``; raises UnknownJobError for an unknown job."""
        return self.runtime(job_id).store

    # ---- rendezvous -------------------------------------------------------------------

    async def join(self, request: JoinRequest) -> rpb.WorldView:
        """Waits until the world of the next generation gathers; this worker's view, encoded.

        Cancelling the call (the caller's deadline) forgets the joiner.
        """
        check_join_limits(self.settings, self.jobs.get(request.job_id), request)
        runtime = self.runtimes.get(request.job_id)
        fresh = runtime is None
        if runtime is None:
            if not request.job_id:
                raise InvalidRequestError("job_id must not be empty")
            if len(self.jobs) >= self.settings.max_jobs and not self._forget_first_ended():
                raise ResourceExhaustedError(
                    f"this coordinator holds {len(self.jobs)} jobs, its limit (max_jobs); "
                    f"job '{request.job_id}' cannot start until one is forgotten"
                )
            # Held aside until the Join is accepted: a refused one leaves no job behind.
            runtime = JobRuntime(
                state.new_job(request.job_id, self.clock(), self.settings.max_events_per_job),
                self._new_store(request.job_id))
        job, joins, key = runtime.job, runtime.joins, request.worker_id
        waiter: asyncio.Future[rpb.WorldView] = new_waiter(
            joins, key, f"a newer Join from worker {request.worker_id} to job "
                        f"'{shown_id(job.job_id)}' replaced this one")
        try:
            effects = state.join(job, request, self.clock())
            if fresh:
                self.runtimes[job.job_id] = runtime
            self.apply(job, effects)
        except BaseException:
            if joins.get(key) is waiter:
                del joins[key]
            raise
        try:
            return await waiter
        except asyncio.CancelledError:
            if joins.get(key) is waiter:
                del joins[key]
                self.apply(job, state.cancel_join(job, request.worker_id, self.clock()))
                self._forget_if_abandoned(job)
            raise

    def reattach(self, request: ReattachRequest) -> bool:
        """A member of a running generation reports in after losing the coordinator.

        Returns:
            True when the job was unknown and has been rebuilt from this report
            (its event history starts again).
        """
        job = self.jobs.get(request.join.job_id)
        restored = job is None
        if job is None:
            check_join_limits(self.settings, None, request.join)
            if len(request.members) > self.settings.max_members_per_job:
                raise InvalidRequestError(
                    f"a world of {len(request.members)} is above this coordinator's limit of "
                    f"{self.settings.max_members_per_job} members per job"
                )
            if len(self.jobs) >= self.settings.max_jobs and not self._forget_first_ended():
                raise ResourceExhaustedError(
                    f"this coordinator holds {len(self.jobs)} jobs, its limit (max_jobs); "
                    f"job '{shown_id(request.join.job_id)}' cannot be restored"
                )
            job = state.restore_job(request, self.clock(), self.settings.max_events_per_job)
            self._await_reattach(job)
        effects = state.reattach(job, request, self.clock())
        if restored:
            self.runtimes[job.job_id] = JobRuntime(job, self._new_store(job.job_id))
            logger.warning(
                "job '%s': generation %d restored from the report of worker %s (no journal "
                "held it); its other members must re-attach within %g s",
                shown_id(job.job_id), job.generation, request.join.worker_id,
                self._reattach_window_s(job))
        # A stream of the generation may open again: its outbox is fresh.
        self.runtimes[job.job_id].outboxes.setdefault(request.join.worker_id,
                                                      Outbox(self._box_limit))
        self.apply(job, effects)
        return restored

    def leave(self, job_id: str, worker_id: str, reason: str, rejoin: bool = False) -> None:
        """A worker leaves on purpose (idempotent); with ``rejoin``, this generation only."""
        job = self.job(job_id)
        self.apply(job, state.leave(job, worker_id, reason, self.clock(), rejoin))
        self._forget_if_abandoned(job)

    def heartbeat(self, job_id: str, worker_id: str,
                  telemetry: state.RankTelemetry | None = None) -> state.HeartbeatReply:
        """Renews a member's lease (keeping the telemetry it carried); the reply says
        how often to renew it."""
        return self._heartbeat(self.job(job_id), worker_id, "unary", telemetry)

    def stream_heartbeat(self, job_id: str, worker_id: str, generation: int,
                         sequence: int, telemetry: state.RankTelemetry | None = None) -> None:
        """A heartbeat on a member's negotiation stream: renews its lease and queues
        the answer on that stream (not counted as a negotiation message)."""
        runtime = self.runtimes.get(job_id)
        outbox = None if runtime is None else runtime.open_streams.get((worker_id, generation))
        if outbox is None or runtime is None:
            return
        job = runtime.job
        answer = state.StreamHeartbeatAnswer(
            sequence, self._heartbeat(job, worker_id, "stream", telemetry))
        outbox.put_nowait(wire.coordinator_message_pb(CoordinatorMessage(heartbeat=answer)))

    def lease_of(self, job: state.Job) -> state.Lease:
        """The job's lease and heartbeat interval, sized to the load."""
        runtime = self.runtimes.get(job.job_id)
        return (runtime.lease if runtime is not None else None) or self.lease_policy.fastest

    def _heartbeat(self, job: state.Job, worker_id: str, transport: str,
                   telemetry: state.RankTelemetry | None) -> state.HeartbeatReply:
        lease = self.lease_of(job)
        runtime = self.runtimes.get(job.job_id)
        if runtime is not None:
            runtime.heartbeats[transport] = runtime.heartbeats.get(transport, 0) + 1
        return state.heartbeat(job, worker_id, self.clock(), lease.lease_s, lease.interval_s,
                               telemetry)

    def get_world(self, job_id: str, worker_id: str) -> state.WorldView:
        """A member's current view."""
        return state.get_world(self.job(job_id), worker_id)

    def report_event(self, job_id: str, kind: str, host: str, message: str) -> None:
        """Records an event the launcher saw in the job's log."""
        job = self.job(job_id)
        check_event_limits(self.settings, kind, host, message)
        state.report_event(job, kind, host, message, self.clock())
        self._persist(job)

    def list_events(self, job_id: str) -> list[state.JobEvent]:
        """The job's event log, oldest first."""
        return state.event_log(self.job(job_id))

    # ---- negotiation ------------------------------------------------------------------

    def open_stream(self, job_id: str, worker_id: str, generation: int,
                    received: Sequence[ReceivedLists] = ()) -> Outbox:
        """Admits a member's negotiation stream (re-sending lists it missed); its outbox.

        Raises:
            AlreadyOpenError: the member already has a stream in this generation.
        """
        runtime = self.runtime(job_id)
        job = runtime.job
        member = state.open_stream(job, worker_id, generation, self.clock())
        stream_key = (worker_id, generation)
        if stream_key in runtime.open_streams:
            raise AlreadyOpenError(
                f"worker {worker_id} already has a negotiation stream for "
                f"job '{job_id}' generation {generation}"
            )
        outbox = runtime.outboxes.setdefault(worker_id, Outbox(self._box_limit))
        runtime.open_streams[stream_key] = outbox
        self.apply(job, state.redeliver(job, member, received))
        return outbox

    def requests(
        self, job_id: str, worker_id: str, generation: int, requests: Sequence[TensorRequest]
    ) -> None:
        """One RequestList arrived on a member's stream (the hot path).

        A request whose name is too long fails alone, before the table sees it.
        """
        job = self.jobs[job_id]
        requests, refused = split_long_tensor_names(self.settings, requests)
        if refused:
            job.errors += len(refused)
            message = CoordinatorMessage(responses=ResponseList(tuple(refused)))
            self.apply(job, [state.Send((worker_id,), message)])
        self.apply(job, state.handle_requests(job, worker_id, generation, requests, self.clock()))

    def stream_closed(self, job_id: str, worker_id: str, generation: int) -> None:
        """A member's stream ended; unless it left first, the member is lost.

        What was still queued for it is dropped with its outbox: nobody reads it.
        """
        runtime = self.runtimes.get(job_id)
        outbox = None if runtime is None else runtime.open_streams.pop((worker_id, generation), None)
        if runtime is not None and outbox is not None:
            if runtime.outboxes.get(worker_id) is outbox:
                del runtime.outboxes[worker_id]
            while not outbox.empty():
                outbox.get_nowait()
        if self.closing:
            return  # our own shutdown cancels every stream; nobody was lost
        job = self.jobs[job_id]
        self.apply(job, state.stream_closed(job, worker_id, generation, self.clock()))

    def deliver_notices(self) -> None:
        """Sends the coalesced departure notices (:mod:`.notices`) to the members
        still active in the generation they concern; each message encoded once."""
        for job_id, worker_ids, message in self._notices.take(self._listening):
            encoded = wire.coordinator_message_pb(message)
            for worker_id in worker_ids:
                self._queue(job_id, worker_id, encoded)

    def _listening(self, job_id: str, worker_id: str, generation: int) -> bool:
        job = self.jobs.get(job_id)
        if job is None or job.generation != generation or job.phase is not state.JobPhase.RUNNING:
            return False
        member = job.by_worker.get(worker_id)
        return member is not None and member.state is state.MemberState.ACTIVE

    def _queue(self, job_id: str, worker_id: str, message: object) -> bool:
        runtime = self.runtimes.get(job_id)
        outbox = None if runtime is None else runtime.outboxes.get(worker_id)
        if runtime is None or outbox is None:
            return False
        outbox.put_nowait(message)
        runtime.messages_queued += 1
        return True

    def outbox_counts(self) -> dict[str, tuple[int, int]]:
        """By job: the outboxes held for its members, and the messages waiting in them."""
        return {job_id: runtime.held_outboxes() for job_id, runtime in self.runtimes.items()
                if runtime.outboxes}

    def _forget(self, job_id: str) -> None:
        """Drops the job and everything held for it: its runtime (store, waiting calls,
        outboxes, lease, counts), its departure notices and what the journal keeps."""
        del self.runtimes[job_id]
        self._notices.forget(job_id)
        self.journal.forget(job_id)

    # ---- doing ------------------------------------------------------------------------

    def apply(self, job: state.Job, effects: Iterable[state.Effect]) -> None:
        """Carries out what a transition decided, in order.

        A message goes on the wire encoded once for all its recipients; the
        views of a world admitted at once share one encoded member list.
        """
        templates: wire.ViewTemplates = {}
        runtime = self.runtimes.get(job.job_id)
        # A job held aside (a fresh Join not yet accepted) has no outboxes yet.
        outboxes = runtime.outboxes if runtime is not None else {}
        for effect in effects:
            if isinstance(effect, state.Send):
                if is_departure(effect.message) and effect.message.event is not None:
                    self._notices.note(job.job_id, effect.worker_ids, effect.message.event)
                    continue  # delivered coalesced, at the next check
                encoded = None
                for worker_id in effect.worker_ids:
                    if worker_id in outboxes:
                        if encoded is None:
                            encoded = wire.coordinator_message_pb(effect.message)
                        self._queue(job.job_id, worker_id, encoded)
            elif isinstance(effect, state.Admit):
                view = wire.world_view_pb(effect.view, templates)
                self._settle(job.job_id, effect.worker_id, view, None)
            elif isinstance(effect, state.Reject):
                self._settle(job.job_id, effect.worker_id, None, effect.error)
            elif isinstance(effect, state.Answer):
                self._answer(job.job_id, effect)
            elif isinstance(effect, state.NewGeneration):
                # Fresh outboxes: a stream of the old generation keeps (and drains) its own.
                for worker_id in effect.worker_ids:
                    outboxes[worker_id] = Outbox(self._box_limit)
            elif isinstance(effect, state.Log):
                logger.log(effect.level, effect.message)
        self._persist(job)

    def _settle(
        self, job_id: str, worker_id: str, view: rpb.WorldView | None, error: Exception | None
    ) -> None:
        runtime = self.runtimes.get(job_id)
        waiter = None if runtime is None else runtime.joins.pop(worker_id, None)
        if waiter is None or waiter.done():
            return
        if error is not None:
            waiter.set_exception(error)
        elif view is not None:
            waiter.set_result(view)

    def end_streams(self) -> None:
        """Asks every open stream to finish (shutdown)."""
        self.closing = True
        boxes = [box for runtime in self.runtimes.values()
                 for box in (*runtime.outboxes.values(), *runtime.open_streams.values())]
        for outbox in {id(box): box for box in boxes}.values():
            outbox.put_nowait(STREAM_END)
