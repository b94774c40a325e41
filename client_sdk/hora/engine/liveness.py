"""Liveness: heartbeats to the coordinator and warnings about stalled tensors.

The heartbeat thread tells the coordinator this rank is alive and learns
from its answers whether the job has failed and whether the host set has
changed (for elastic training). It starts as soon as the world is joined, so
that bootstrapping the data plane never outlasts the lease, with unary
Heartbeat calls; once the negotiation stream is open (:meth:`Liveness.attach`)
it heartbeats on that stream instead, which costs the coordinator about a
third of a call. Each heartbeat carries this rank's telemetry for the
dashboard (:mod:`.telemetry`), a few dozen bytes. The coordinator says how often (``interval_ms``): it sizes
interval and lease to its load. Silence from the coordinator for longer than
the outage timeout fails the generation; shorter silences (a restart, a
pause) are waited out while training goes on. The coordinator warns of stalled negotiations itself; the cached
tensors it never sees are checked here.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence

from hora_proto.v1 import negotiation_pb2, rendezvous_pb2

from .._client import CoordinatorLink
from ..errors import CoordinatorError, HorovodInternalError
from ..settings import Settings
from .pending import Entry, Pending
from .telemetry import TELEMETRY

__all__ = ["Liveness"]

log = logging.getLogger("hora")

# Cached entries newly stalled past a limit (seconds), the peers the agreement
# round in progress waits for, and what the others wait in, if known.
StallCheck = Callable[[float], tuple[Sequence[Entry], Sequence[int], str]]


class Liveness:
    """The heartbeat thread of one generation.

    Args:
        settings: the worker's settings (the interval when the coordinator names
            none, the connect timeout, the stall warning time).
        client: the coordinator client, for the unary heartbeats.
    """

    def __init__(self, settings: Settings, client: CoordinatorLink, generation: int,
                 rank: int, pending: Pending) -> None:
        self._settings = settings
        self._client = client
        self._generation = generation
        self._rank = rank
        self._pending = pending
        self._send_on_stream: Callable[[int, rendezvous_pb2.RankTelemetry], None] | None = None
        self._cached_stalls: StallCheck | None = None
        self._sequence = 0
        self._interval = settings.heartbeat_interval.total_seconds()
        self._last_answer = time.monotonic()
        self.host_epoch: tuple[int, bool] = (0, False)
        self.note(client.heartbeat(generation))
        self.thread = threading.Thread(target=self._loop, name="hora-heartbeat", daemon=True)

    def attach(self, send_on_stream: Callable[[int, rendezvous_pb2.RankTelemetry], None],
               cached_stalls: StallCheck) -> None:
        """From now on, heartbeats go on the negotiation stream
        (``send_on_stream(sequence, telemetry)``); the stream's reader hands their
        answers to :meth:`answered`."""
        self._cached_stalls = cached_stalls
        self._send_on_stream = send_on_stream

    def note(self, reply: rendezvous_pb2.HeartbeatResponse) -> None:
        """Takes in one heartbeat answer, unary or from the stream."""
        self._last_answer = time.monotonic()
        if reply.interval_ms > 0:
            self._interval = reply.interval_ms / 1000.0
        if reply.job_state == rendezvous_pb2.JOB_STATE_FAILED:
            self._pending.fail(HorovodInternalError(f"the job failed: {reply.failure}"))
        self.host_epoch = (reply.host_update_epoch, reply.removals_only)

    def answered(self, answer: negotiation_pb2.StreamHeartbeatAnswer) -> None:
        """The answer to a heartbeat sent on the stream (called by the stream's reader)."""
        self.note(answer.state)

    def _loop(self) -> None:
        # The ranks of a job start together: a random first phase keeps their
        # heartbeats from reaching the coordinator in one burst every interval.
        if self._pending.stopping.wait(random.uniform(0.5, 1.0) * self._interval):
            return
        while not self._pending.stopping.wait(self._interval):
            send = self._send_on_stream
            if send is not None:
                self._sequence += 1
                send(self._sequence, TELEMETRY.summary())
            else:
                try:
                    self.note(self._client.heartbeat(self._generation, TELEMETRY.summary()))
                except CoordinatorError as exc:
                    log.debug("heartbeat failed: %s", exc)
            # The coordinator may be away (restarting, stopped, the network
            # down): training goes on meanwhile, up to the outage timeout.
            grace = max(self._settings.coordinator_outage_timeout.total_seconds(),
                        3 * self._interval)
            silent = time.monotonic() - self._last_answer
            if silent > grace:
                self._pending.fail(HorovodInternalError(
                    f"no heartbeat answer from the coordinator {self._settings.coordinator} "
                    f"for {silent:.1f} s, longer than the outage timeout of {grace:g} s "
                    f"(HORA_COORDINATOR_OUTAGE_TIMEOUT)"))
                return
            self._warn_cached_stalls()

    def _warn_cached_stalls(self) -> None:
        limit = self._settings.stall_warning_time.total_seconds()
        if limit <= 0 or self._cached_stalls is None:
            return
        stalled, waiting, doing = self._cached_stalls(limit)
        missing = f"; ranks {sorted(waiting)} have not come to the agreement round" \
            if waiting else ""
        if doing:
            missing += f"; {doing}"
        for entry in stalled:
            log.warning("rank %d: tensor %r (negotiated before, agreed peer to peer) has "
                        "waited more than %g s for the other ranks to submit it%s", self._rank,
                        entry.name, limit, missing)
