"""What this worker tells the dashboard: steps, step times, lateness at rounds, cache use.

One :class:`Telemetry` per process (:data:`TELEMETRY`), so that step counts
go on across elastic generations. Everything is a bounded summary, folded
into the heartbeats the worker sends anyway (:meth:`Telemetry.summary`):
nothing here sends a message of its own.

Lateness at the agreement rounds is measured without comparing clocks across
hosts. Each rank times its own wait in a round (from handing in its vector to
the agreed answer) and hands that wait in with its next round's vector, as
both ``w`` and ``-w``; the MIN every round computes anyway then gives the
longest and the shortest wait of the previous round. The rank that arrived
first waited longest, so a rank's lateness behind the first is
``longest - own``, and the rank with the shortest wait arrived last.
"""

from __future__ import annotations

import collections
import threading
import time

from hora_proto.v1 import rendezvous_pb2

__all__ = ["TELEMETRY", "Telemetry"]

# Rounds the lateness figures cover.
ROUNDS_KEPT = 256
# Steps per second are counted over this window (seconds).
RATE_WINDOW_S = 5.0
# Below this spread of waits nobody is said to have arrived last: the ranks
# came together, and who won by microseconds is noise.
LAST_SPREAD_US = 200


class Telemetry:
    """Counters and bounded windows, safe to feed from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps = 0
        self.batch_size = 0
        self.cache_hits = 0
        self.cache_misses = 0
        self._last_step_s = 0.0
        self._step_times: collections.deque[float] = collections.deque(maxlen=4096)
        # (lateness in microseconds, arrived last) per round, newest last.
        self._rounds: collections.deque[tuple[int, bool]] = collections.deque(maxlen=ROUNDS_KEPT)

    def step(self) -> None:
        """One training step done (``DistributedOptimizer.step`` calls it)."""
        now = time.monotonic()
        with self._lock:
            if self._step_times:
                self._last_step_s = now - self._step_times[-1]
            self._step_times.append(now)
            self.steps += 1

    def set_batch_size(self, samples: int) -> None:
        """Samples per step on this rank, for the dashboard's samples per second."""
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError(f"the batch size must be an int >= 0, got {samples!r}")
        self.batch_size = samples

    def cache(self, hits: int, misses: int) -> None:
        """Tensors agreed from the response cache, and tensors sent to the coordinator."""
        with self._lock:
            self.cache_hits += hits
            self.cache_misses += misses

    def round(self, own_us: int, longest_us: int, shortest_us: int) -> None:
        """The waits of a round that every rank reported: this rank's, and the
        longest and shortest of all (microseconds)."""
        late = max(0, longest_us - own_us)
        last = own_us <= shortest_us and longest_us - shortest_us >= LAST_SPREAD_US
        with self._lock:
            self._rounds.append((late, last))

    def new_world(self) -> None:
        """A new generation: the ranks are others, so their lateness starts again."""
        with self._lock:
            self._rounds.clear()

    def summary(self) -> rendezvous_pb2.RankTelemetry:
        """The bounded summary a heartbeat carries."""
        now = time.monotonic()
        with self._lock:
            recent = [t for t in self._step_times if now - t <= RATE_WINDOW_S]
            rounds = list(self._rounds)
            summary = rendezvous_pb2.RankTelemetry(
                steps=self.steps, last_step_s=self._last_step_s, batch_size=self.batch_size,
                cache_hits=self.cache_hits, cache_misses=self.cache_misses)
        if len(recent) >= 2:
            # Steps over the window up to now: a loop that stopped decays to 0.
            summary.steps_per_s = (len(recent) - 1) / max(now - recent[0], 1e-6)
        if rounds:
            late = sorted(ms for ms, _last in rounds)
            summary.rounds = len(rounds)
            summary.lateness_p50_ms = late[len(late) // 2] / 1000.0
            summary.lateness_p95_ms = late[min(len(late) - 1, int(len(late) * 0.95))] / 1000.0
            summary.last_arrivals = sum(1 for _ms, last in rounds if last)
        return summary


#: This process's telemetry.
TELEMETRY = Telemetry()
