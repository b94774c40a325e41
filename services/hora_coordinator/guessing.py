"""Slowing down whoever guesses tokens: a failure budget per client address.

Each address has a bucket of ``burst`` wrong tokens that refills at ``per_s``
a second. While its bucket is empty the address is *limited*: its calls are
refused (RESOURCE_EXHAUSTED on gRPC, 429 over HTTP) without their token being
looked at, so a guess made then tells the guesser nothing, right or wrong; a
guesser gets about ``per_s`` answers a second instead of thousands.

The right token is never slowed: an address that sends no wrong token has no
bucket at all, and a *connection* (gRPC peer, address and port) that has
proved a token before keeps working while its address is limited, so a
worker that shares its address with a guesser (one host, one NAT) is not
cut off; only new connections from that address wait. A connection that
sends a wrong token loses that standing.

Memory is bounded: at most ``max_addresses`` buckets and ``max_connections``
proven connections; past that the oldest are forgotten (a forgotten bucket is
a full one: the worst an attacker with many addresses gains is ``burst``
guesses per address).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["GuessLimiter", "address_of_peer"]


def address_of_peer(peer: str) -> str:
    """The client address of a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6" and rest.startswith("["):
        return rest[1:rest.find("]")] if "]" in rest else rest
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0] or rest
    return peer  # unix sockets and others: the whole string


class GuessLimiter:
    """Failure buckets per address and the connections that proved a token.

    Args:
        burst: Wrong tokens an address may send before it is limited (0: never limited).
        per_s: How many more it may send per second once limited.
        max_addresses: Most buckets kept.
        max_connections: Most proven connections remembered.
        clock: Monotonic seconds (tests pass a fake).
    """

    def __init__(self, burst: int = 30, per_s: float = 1.0, max_addresses: int = 4096,
                 max_connections: int = 16384,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst = burst
        self.per_s = per_s
        self._max_addresses = max_addresses
        self._max_connections = max_connections
        self._clock = clock
        # address -> (tokens left, when counted)
        self._buckets: dict[str, tuple[float, float]] = {}
        self._proven: dict[str, None] = {}

    def _left(self, address: str, now: float) -> float:
        entry = self._buckets.get(address)
        if entry is None:
            return float(self.burst)
        left, since = entry
        return min(float(self.burst), left + (now - since) * self.per_s)

    def limited(self, address: str) -> bool:
        """Whether ``address`` has spent its budget (a new guess would be refused)."""
        if self.burst <= 0 or not self._buckets:
            return False
        return self._left(address, self._clock()) < 1.0

    def failed(self, address: str, connection: str) -> None:
        """``connection`` from ``address`` sent a wrong (or no) token."""
        self._proven.pop(connection, None)
        if self.burst <= 0:
            return
        now = self._clock()
        left = self._left(address, now) - 1.0
        self._buckets.pop(address, None)  # re-insert: the newest last
        self._buckets[address] = (max(left, 0.0), now)
        if len(self._buckets) > self._max_addresses:
            self._prune(now)

    def _prune(self, now: float) -> None:
        full = [a for a in self._buckets if self._left(a, now) >= self.burst]
        for address in full:
            del self._buckets[address]
        while len(self._buckets) > self._max_addresses:
            del self._buckets[next(iter(self._buckets))]

    def proved(self, connection: str) -> None:
        """``connection`` sent a right token: it keeps working if its address is limited."""
        if connection in self._proven:
            return
        self._proven[connection] = None
        if len(self._proven) > self._max_connections:
            del self._proven[next(iter(self._proven))]

    def admits(self, address: str, connection: str) -> bool:
        """Whether a call on ``connection`` may have its token checked now."""
        return connection in self._proven or not self.limited(address)

    def __len__(self) -> int:
        return len(self._buckets)
