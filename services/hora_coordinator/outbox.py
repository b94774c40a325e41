"""A member's outbox: the messages waiting to go out on its negotiation stream.

Bounded: a client that sends on its stream but reads nothing (its HTTP/2
window stays full, so the messages pile up here) grew the coordinator by
~300 MB in 45 s (issue 25). Past ``limit`` waiting messages the outbox drops
what it holds, takes no more, and tells its stream, which ends the call: the
member is lost like one whose connection broke.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["STREAM_END", "Outbox"]

# Put in an outbox to end its stream; the bound never refuses it.
STREAM_END = None


class Outbox(asyncio.Queue):  # of npb.CoordinatorMessage | None
    """An asyncio queue of at most ``limit`` messages, then overflowed for good."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.overflowed = False
        self._on_overflow: Callable[[], Any] | None = None

    def on_overflow(self, callback: Callable[[], Any]) -> None:
        """Calls ``callback`` when the outbox overflows (at once if it has)."""
        self._on_overflow = callback
        if self.overflowed:
            callback()

    def put_nowait(self, item: Any) -> None:
        if item is not STREAM_END and self.qsize() >= self.limit:
            if not self.overflowed:
                self.overflowed = True
                while not self.empty():
                    self.get_nowait()
                if self._on_overflow is not None:
                    self._on_overflow()
            return
        if self.overflowed and item is not STREAM_END:
            return
        super().put_nowait(item)
