"""Liveness: heartbeats to the coordinator and warnings about stalled tensors.

The heartbeat thread tells the coordinator this rank is alive and learns
from its answers whether the job has failed and whether the host set has
changed (for elastic training). Silence from the coordinator for longer
than the outage timeout fails the generation; shorter silences (a restart,
a pause) are waited out while training goes on. The coordinator warns of stalled negotiations itself; the
cached tensors it never sees are checked here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from hora_proto.v1 import rendezvous_pb2

from .._client import CoordinatorLink
from ..errors import CoordinatorError, HorovodInternalError
from ..settings import Settings
from .pending import Entry, Pending

__all__ = ["Liveness"]

log = logging.getLogger("hora")

# Cached entries newly stalled past a limit (seconds), and the peers the
# agreement round in progress waits for.
StallCheck = Callable[[float], tuple[Sequence[Entry], Sequence[int]]]


class Liveness:
    """The heartbeat thread of one generation."""

    def __init__(self, settings: Settings, client: CoordinatorLink, generation: int,
                 rank: int, pending: Pending, cached_stalls: StallCheck) -> None:
        self._settings = settings
        self._client = client
        self._generation = generation
        self._rank = rank
        self._pending = pending
        self._cached_stalls = cached_stalls
        self.host_epoch: tuple[int, bool] = (0, False)
        self.note(client.heartbeat(generation))
        self.thread = threading.Thread(target=self._loop, name="hora-heartbeat", daemon=True)

    def note(self, reply: rendezvous_pb2.HeartbeatResponse) -> None:
        """Takes in one heartbeat answer."""
        if reply.job_state == rendezvous_pb2.JOB_STATE_FAILED:
            self._pending.fail(HorovodInternalError(f"the job failed: {reply.failure}"))
        self.host_epoch = (reply.host_update_epoch, reply.removals_only)

    def _loop(self) -> None:
        interval = self._settings.heartbeat_interval.total_seconds()
        # The coordinator may be away (restarting, stopped, the network down):
        # training goes on meanwhile, up to the outage timeout.
        grace = max(self._settings.coordinator_outage_timeout.total_seconds(), 3 * interval)
        last_ok = time.monotonic()
        while not self._pending.stopping.wait(interval):
            try:
                reply = self._client.heartbeat(self._generation)
            except CoordinatorError as exc:
                if time.monotonic() - last_ok > grace:
                    self._pending.fail(HorovodInternalError(
                        f"no heartbeat answer from the coordinator "
                        f"{self._settings.coordinator} for {grace:g} s "
                        f"(HORA_COORDINATOR_OUTAGE_TIMEOUT): {exc}"))
                    return
                continue
            last_ok = time.monotonic()
            self.note(reply)
            self._warn_cached_stalls()

    def _warn_cached_stalls(self) -> None:
        limit = self._settings.stall_warning_time.total_seconds()
        if limit <= 0:
            return
        stalled, waiting = self._cached_stalls(limit)
        missing = f"; ranks {sorted(waiting)} have not come to the agreement round" \
            if waiting else ""
        for entry in stalled:
            log.warning("rank %d: tensor %r (negotiated before, agreed peer to peer) has "
                        "waited more than %g s for the other ranks to submit it%s", self._rank,
                        entry.name, limit, missing)
