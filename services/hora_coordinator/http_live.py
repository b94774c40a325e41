"""Bounds on the live (server-sent events) streams: how many, and shared work.

100 live streams on a coordinator with 10k jobs took 99% CPU and moved gRPC
latency from 1.6 to 766 ms (issue 25): each stream recomputed the jobs list
every tick. Now at most ``max_live_streams`` are open (one more is 503), and
streams that send the same thing share one computation per tick.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable

from fastapi import HTTPException, Request

__all__ = ["LiveSlot", "LiveStreams", "live_streams"]

# Shared computations remembered at most (a page of the jobs list each).
_MAX_SHARED = 256


class LiveSlot:
    """One open live stream; releasing it twice is harmless."""

    def __init__(self, streams: LiveStreams) -> None:
        self._streams = streams
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._streams.open_count -= 1


class LiveStreams:
    """The live streams of one app: their count, and their shared computations."""

    def __init__(self) -> None:
        self.open_count = 0
        self._shared: dict[Hashable, tuple[float, asyncio.Future[bytes]]] = {}

    def open(self, limit: int) -> LiveSlot:
        """A slot for one more stream.

        Raises:
            HTTPException: 503, ``limit`` streams are open.
        """
        if self.open_count >= limit:
            raise HTTPException(
                status_code=503,
                detail=f"{self.open_count} live streams are open, the limit (max_live_streams)",
                headers={"Retry-After": "5"},
            )
        self.open_count += 1
        return LiveSlot(self)

    async def tick(self, key: Hashable, compute: Callable[[], Awaitable[bytes]],
                   tick_s: float = 0.5) -> bytes:
        """``compute()``'s result, computed at most once per ``tick_s`` for ``key``."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        hit = self._shared.get(key)
        future: asyncio.Future[bytes]
        # A little under a tick: streams that tick together share, not alternate.
        if hit is None or now - hit[0] >= 0.8 * tick_s:
            future = asyncio.ensure_future(compute())
            self._shared[key] = (now, future)
            if len(self._shared) > _MAX_SHARED:
                oldest = min(self._shared, key=lambda k: self._shared[k][0])
                del self._shared[oldest]
        else:
            future = hit[1]
        # One stream leaving must not cancel what the others wait for.
        return await asyncio.shield(future)


def live_streams(request: Request) -> LiveStreams:
    """The app's :class:`LiveStreams` (made on first use)."""
    state = request.app.state
    streams = getattr(state, "live_streams", None)
    if streams is None:
        streams = state.live_streams = LiveStreams()
    return streams
