"""The negotiation stream: requests to the coordinator, its answers back.

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
from collections.abc import Callable, Sequence

from hora_proto.v1 import negotiation_pb2

from .._client import CoordinatorLink
from ..errors import CoordinatorError, HorovodInternalError, RankLostError
from ..settings import Settings
from .executor import RESPONSE_OP, Executor
from .pending import Pending
from .process_sets import ProcessSets, ResponseList

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
                 on_heartbeat: Callable[[negotiation_pb2.StreamHeartbeatAnswer], None]) -> None:
        self._settings = settings
        self._rank = rank
        self._pending = pending
        self._executor = executor
        self._sets = sets
        self._on_global_list = on_global_list
        self._on_heartbeat = on_heartbeat
        self._stream = client.open_stream(generation)
        self.thread = threading.Thread(target=self._read_loop, name="hora-reader", daemon=True)

    def send(self, request: negotiation_pb2.TensorRequest) -> None:
        self._stream.send(request)

    def heartbeat(self, sequence: int) -> None:
        """Renews this member's lease on the stream; the answer goes to ``on_heartbeat``."""
        self._stream.heartbeat(sequence)

    def close(self) -> None:
        self._stream.close()

    def _read_loop(self) -> None:
        try:
            for message in self._stream:
                kind = message.WhichOneof("kind")
                if kind == "responses":
                    self._dispatch(message.responses.responses)
                elif kind == "event":
                    self._on_event(message.event)
                elif kind == "heartbeat":
                    self._on_heartbeat(message.heartbeat)
        except CoordinatorError as exc:
            if not self._pending.stopping.is_set():
                self._pending.fail(HorovodInternalError(f"lost the coordinator: {exc}"))
        else:
            if not self._pending.stopping.is_set():
                self._pending.fail(HorovodInternalError(
                    f"the coordinator {self._settings.coordinator} closed the negotiation "
                    f"stream"))
        finally:
            with self._pending.lock:
                self._pending.work.notify_all()
            self._sets.stop()

    def _dispatch(self, responses: Sequence[negotiation_pb2.Response]) -> None:
        """Routes one response list: errors at once, collectives to their set's executor."""
        by_set: dict[int, ResponseList] = {}
        timeline = self._executor.timeline
        errors = False
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
            log.warning(
                "rank %d: tensor %s has waited more than %g s for rank(s) %s to submit it; "
                "one rank may be doing different work (or a different number of steps)",
                self._rank, ", ".join(repr(n) for n in event.tensor_names),
                self._settings.stall_warning_time.total_seconds(), list(event.missing_ranks))
