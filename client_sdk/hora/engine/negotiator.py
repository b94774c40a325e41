"""The negotiation stream: requests to the coordinator, its answers back.

When the stream breaks (the coordinator died, restarts, or the network
dropped), the generation goes on: cached steps need no coordinator. The
reader re-attaches to the job with backoff (:meth:`Negotiator._reattach`),
for up to ``HORA_COORDINATOR_OUTAGE_TIMEOUT``, opens a new stream for the
same generation and sends again every request still unanswered. Only a
refusal (the generation ended meanwhile) or the timeout fails the generation.

:meth:`Negotiator.send` puts a request on the stream, :meth:`Negotiator.heartbeat`
a heartbeat (whose answer goes to the liveness thread). The reader thread
receives ordered response lists and events. Error responses complete their
handles at once (they move no bytes, and some go to one rank only, so they
must not take part in the rounds every rank counts); the global set's lists
go to the agreement rounds, other sets' lists to their threads. Events (a
lost rank, a failed job) fail the generation at once, so that waiting
callers learn of a dead peer even while a collective is stuck.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from hora_proto.v1 import negotiation_pb2, rendezvous_pb2

from .._client import CoordinatorLink
from ..errors import (
    AuthenticationError,
    CoordinatorError,
    CoordinatorUnavailableError,
    HorovodInternalError,
    RankLostError,
)
from ..settings import Settings
from .executor import RESPONSE_OP, Executor, TimelineRef
from .pending import Pending
from .process_sets import ProcessSets, ResponseList
from .received import ReceivedLog

__all__ = ["Negotiator"]

log = logging.getLogger("hora")


class Negotiator:
    """The stream of one generation and the thread that reads it.

    Args:
        on_global_list: takes one of the global set's response lists (the
            agreement rounds run them).
        on_heartbeat: takes the answer to a heartbeat sent with :meth:`heartbeat`.
    """

    def __init__(self, settings: Settings, client: CoordinatorLink, generation: int,
                 rank: int, pending: Pending, executor: Executor, sets: ProcessSets,
                 on_global_list: Callable[[ResponseList], None],
                 on_heartbeat: Callable[[negotiation_pb2.StreamHeartbeatAnswer], None],
                 timeline: TimelineRef, reattach: Callable[[], bool] | None = None) -> None:
        self._settings = settings
        self._client = client
        self._generation = generation
        self._rank = rank
        self._pending = pending
        self._executor = executor
        self._timeline = timeline
        self._sets = sets
        self._on_global_list = on_global_list
        self._on_heartbeat = on_heartbeat
        self._reattach_call = reattach
        # Requests sent and not answered yet, by name: what a new stream sends again.
        self._awaiting: dict[str, negotiation_pb2.TensorRequest] = {}
        # By process set: the numbered lists received (the reader thread's own), which
        # a new stream reports so that a list some ranks missed is re-sent to them.
        self._received = ReceivedLog()
        self._send_lock = threading.Lock()
        self._stream = client.open_stream(generation)
        self.thread = threading.Thread(target=self._read_loop, name="hora-reader", daemon=True)

    def send(self, request: negotiation_pb2.TensorRequest) -> None:
        with self._send_lock:
            self._awaiting[request.name] = request
            self._stream.send(request)

    def heartbeat(self, sequence: int,
                  telemetry: rendezvous_pb2.RankTelemetry | None = None) -> None:
        """Renews this member's lease on the stream; the answer goes to ``on_heartbeat``.
        (While the coordinator is away it goes nowhere, which is fine.)"""
        with self._send_lock:
            self._stream.heartbeat(sequence, telemetry)

    def close(self) -> None:
        self._stream.close()

    def _read_loop(self) -> None:
        try:
            while True:
                try:
                    for message in self._stream:
                        kind = message.WhichOneof("kind")
                        if kind == "responses":
                            if self._received.first_time(message.responses):
                                self._dispatch(message.responses.responses)
                        elif kind == "event":
                            self._on_event(message.event)
                        elif kind == "heartbeat":
                            self._on_heartbeat(message.heartbeat)
                    lost: CoordinatorError = CoordinatorUnavailableError(
                        f"the coordinator {self._settings.coordinator} closed the negotiation "
                        f"stream")
                except (AuthenticationError, CoordinatorUnavailableError) as exc:
                    lost = exc
                except CoordinatorError as exc:  # it refused the stream: nothing to wait for
                    if not self._pending.stopping.is_set():
                        self._pending.fail(HorovodInternalError(f"lost the coordinator: {exc}"))
                    return
                if self._pending.stopping.is_set() or not self._reattach(lost):
                    return
        finally:
            with self._pending.lock:
                self._pending.work.notify_all()
            self._sets.stop()

    def _reattach(self, lost: CoordinatorError) -> bool:
        """Re-attaches to the job after the stream broke; False when the generation
        failed instead (the outage outlasted its timeout, or the coordinator refused)."""
        limit = self._settings.coordinator_outage_timeout.total_seconds()
        if self._reattach_call is None or isinstance(lost, AuthenticationError):
            self._pending.fail(HorovodInternalError(f"lost the coordinator: {lost}"))
            return False
        since = self._client.outage_started()
        log.warning("rank %d: lost the coordinator %s (%s); training goes on peer to peer "
                    "while it re-attaches, for up to %g s (HORA_COORDINATOR_OUTAGE_TIMEOUT)",
                    self._rank, self._settings.coordinator, lost, limit)
        backoff = 0.1
        while not self._pending.over():
            try:
                restored = self._reattach_call()
            except CoordinatorUnavailableError as exc:
                if time.monotonic() - since >= limit:
                    self._pending.fail(HorovodInternalError(
                        f"the coordinator {self._settings.coordinator} has been unreachable for "
                        f"{limit:g} s (HORA_COORDINATOR_OUTAGE_TIMEOUT): {exc}"))
                    return False
                self._pending.stopping.wait(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            except CoordinatorError as exc:
                # The generation ended while we were away (a peer was lost): as after
                # any loss, the generation fails and an elastic job resets.
                self._pending.fail(RankLostError(
                    f"the coordinator {self._settings.coordinator} is back but refused "
                    f"rank {self._rank}'s re-attach: {exc}"))
                return False
            with self._send_lock:
                self._stream = self._client.open_stream(self._generation,
                                                        self._received.report())
                for request in self._awaiting.values():
                    self._stream.send(self._received.resent(request))
                resent = len(self._awaiting)
            self._client.outage_over()
            log.warning("rank %d: re-attached to the coordinator %s after %.1f s: generation "
                        "%d goes on, no reset%s%s", self._rank, self._settings.coordinator,
                        time.monotonic() - since, self._generation,
                        f"; {resent} request(s) sent again" if resent else "",
                        "; it had restarted without a journal and rebuilt the job from "
                        "the members' reports" if restored else "")
            return True
        return False

    def _dispatch(self, responses: Sequence[negotiation_pb2.Response]) -> None:
        """Routes one response list: errors at once, collectives to their set's executor."""
        by_set: dict[int, ResponseList] = {}
        timeline = self._timeline.current
        errors = False
        self._answered(responses)
        for response in responses:
            for name in response.tensor_names:
                timeline.negotiate_end(name)
            if response.type == negotiation_pb2.RESPONSE_TYPE_ERROR:
                self._executor.execute(response)
                errors = True
            else:
                op = RESPONSE_OP.get(response.type)
                for name in response.tensor_names:
                    if op is not None:
                        timeline.start(name, op)
                    timeline.activity_start(name, "QUEUE")
                by_set.setdefault(response.process_set_id, []).append(response)
        for set_id, batch in by_set.items():
            if set_id == 0:
                self._on_global_list(batch)
            else:
                self._sets.deliver(set_id, batch)
        if errors:
            with self._pending.lock:
                self._pending.work.notify_all()  # callers waiting on a failed handle

    def _answered(self, responses: Sequence[negotiation_pb2.Response]) -> None:
        """Forgets the requests ``responses`` answer (a join's answer names no tensor)."""
        with self._send_lock:
            for response in responses:
                for name in response.tensor_names:
                    self._awaiting.pop(name, None)
                if response.type == negotiation_pb2.RESPONSE_TYPE_JOIN:
                    for name, request in list(self._awaiting.items()):
                        if (request.op_type == negotiation_pb2.OP_TYPE_JOIN
                                and request.process_set_id == response.process_set_id):
                            del self._awaiting[name]

    def _on_event(self, event: negotiation_pb2.Event) -> None:
        if event.type == negotiation_pb2.EVENT_TYPE_MEMBER_LOST:
            self._pending.fail(RankLostError(
                f"rank {event.rank} (host {event.host}, pid {event.pid}) was lost: "
                f"{event.message}"))
        elif event.type == negotiation_pb2.EVENT_TYPE_JOB_FAILED:
            self._pending.fail(HorovodInternalError(f"the job failed: {event.message}"))
        elif event.type == negotiation_pb2.EVENT_TYPE_MEMBER_LEFT:
            log.info("rank %d (host %s, pid %d) left the job", event.rank, event.host, event.pid)
        elif event.type == negotiation_pb2.EVENT_TYPE_STALL_WARNING:
            # The coordinator's message adds what each missing rank is blocked in,
            # when it knows ("rank 1 is waiting in allgather 'b'").
            log.warning(
                "rank %d: tensor %s has waited more than %g s for rank(s) %s to submit it; "
                "one rank may be doing different work (or a different number of steps). "
                "Coordinator: %s",
                self._rank, ", ".join(repr(n) for n in event.tensor_names),
                self._settings.stall_warning_time.total_seconds(), list(event.missing_ranks),
                event.message)
