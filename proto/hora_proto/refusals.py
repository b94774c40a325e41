"""Rate-limited warnings about refused peers: the coordinator's calls and the mesh's connections.

A flood of bad calls or strangers must not flood the log. :class:`RefusalLog`
writes the first refusal of each kind, counts the ones that follow within an
interval, and says how many it left out on the next line of that kind.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable

__all__ = ["RefusalLog"]

# Kinds remembered at most; a stranger varying its address cannot grow the table further.
MAX_KINDS = 1024


class RefusalLog:
    """At most one WARNING line per kind of refusal per ``interval_s``; thread-safe.

    Args:
        interval_s: Seconds between two lines of one kind; 0 logs every refusal.
        logger: Where the lines go.
        clock: Monotonic seconds; injectable for tests.
    """

    def __init__(self, interval_s: float, logger: logging.Logger,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._logger = logger
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[Hashable, float] = {}
        self._left_out: dict[Hashable, int] = {}

    def refused(self, kind: Hashable, text: str) -> None:
        """Logs ``text`` unless a line of ``kind`` went out less than the interval ago."""
        left_out = self.admit(kind)
        if left_out is None:
            return
        if left_out:
            text += f" ({left_out} more like it since the last such line)"
        self._logger.warning("%s", text)

    def admit(self, kind: Hashable) -> int | None:
        """Whether a line of ``kind`` may go out now: None if not (it is counted),
        else how many were left out since the last one (the caller writes the line)."""
        with self._lock:
            now = self._clock()
            last = self._last.get(kind)
            if last is not None and now - last < self._interval_s:
                self._left_out[kind] = self._left_out.get(kind, 0) + 1
                return None
            if len(self._last) >= MAX_KINDS:
                self._forget_quiet(now)
            self._last[kind] = now
            return self._left_out.pop(kind, 0)

    def __len__(self) -> int:
        """Kinds remembered now (bounded by MAX_KINDS)."""
        with self._lock:
            return len(self._last)

    def clear(self) -> None:
        """Forgets every kind (tests start from a clean slate)."""
        with self._lock:
            self._last.clear()
            self._left_out.clear()

    def _forget_quiet(self, now: float) -> None:
        """Drops kinds whose interval has passed; if none has, the oldest half."""
        stale = [k for k, t in self._last.items() if now - t >= self._interval_s]
        if not stale:
            stale = sorted(self._last, key=self._last.__getitem__)[:len(self._last) // 2]
        for kind in stale:
            del self._last[kind]
            left_out = self._left_out.pop(kind, 0)
            if left_out:
                self._logger.warning("%d more refusals of kind %r since its last line",
                                     left_out, kind)
