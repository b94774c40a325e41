"""Bounds on the coordinator's connections, so that no flood of them takes it down.

The HTTP server accepts through :class:`GatedListener`, not asyncio's own
accept loop: a connection past the cap (per client address, or in total) is
closed as it is accepted, before it costs anything lasting; when the process
is out of file descriptors the listener pauses instead of spinning (asyncio's
loop logged a traceback per try: 513k of them in 30 s). A connection that has
not sent a whole request head within the header timeout is closed
(:class:`GatedH11Protocol`). The gRPC server gets its caps from gRPC core's
own channel arguments (:func:`grpc_connection_options`).

Lines about refused or broken connections, ours and uvicorn's, asyncio's and
gRPC's Python loggers', go through a :class:`~hora_proto.refusals.RefusalLog`
(:func:`rate_limited_loggers`): at most one per kind per interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import resource
import socket
import ssl
from collections.abc import Callable, Iterator
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from hora_proto.refusals import RefusalLog

from .settings import CoordinatorSettings

__all__ = [
    "ConnectionGate",
    "GatedH11Protocol",
    "GatedListener",
    "grpc_connection_options",
    "raise_open_file_limit",
    "rate_limited_loggers",
]

# Loggers that write a line per refused or broken connection, left to themselves.
NOISY_LOGGERS = ("uvicorn.error", "asyncio", "grpc._cython.cygrpc", "grpc._server",
                 "grpc.aio._server")
# Accept errors that mean "out of descriptors or memory": wait, do not spin.
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_ACCEPT_PAUSE_S = 0.5
# Connections one wake-up of the listener takes at most, so a flood cannot hold the loop.
_ACCEPTS_PER_WAKE = 64
# Descriptors kept for the process itself (journal, pipes, self-check, logs).
_FD_RESERVE = 128
_LARGEST_FD_LIMIT = 1 << 20


def raise_open_file_limit() -> int:
    """Raises this process's soft open-file limit to its hard one; the soft limit now.

    Headroom only: the caps below are what bound a flood.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _LARGEST_FD_LIMIT if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def grpc_connections_cap(settings: CoordinatorSettings) -> int:
    """``max_grpc_connections``, or when 0, what the open-file limit leaves."""
    if settings.max_grpc_connections:
        return settings.max_grpc_connections
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = _LARGEST_FD_LIMIT
    return max(16, soft - settings.max_http_connections - _FD_RESERVE)


def grpc_connection_options(settings: CoordinatorSettings) -> list[tuple[str, int]]:
    """gRPC core's own bounds: total connections, handshake deadline, idle connections."""
    return [
        ("grpc.max_allowed_incoming_connections", grpc_connections_cap(settings)),
        ("grpc.server_handshake_timeout_ms",
         int(settings.header_timeout.total_seconds() * 1000)),
        ("grpc.max_connection_idle_ms", int(settings.grpc_idle_timeout.total_seconds() * 1000)),
    ]


class _Ticket:
    """One admitted connection; releasing it twice is harmless."""

    __slots__ = ("_gate", "address", "_held")

    def __init__(self, gate: ConnectionGate, address: str) -> None:
        self._gate = gate
        self.address = address
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._gate.release(self.address)


class ConnectionGate:
    """Counts open connections in total and per client address; not thread-safe."""

    def __init__(self, total: int, per_address: int) -> None:
        self._total = total
        self._per_address = per_address
        self._open: dict[str, int] = {}
        self.count = 0

    def admit(self, address: str) -> _Ticket | str:
        """A ticket for one more connection from ``address``, or why there is none."""
        if self.count >= self._total:
            return f"{self.count} HTTP connections are open, the limit (max_http_connections)"
        held = self._open.get(address, 0)
        if held >= self._per_address:
            return (f"{held} HTTP connections from {address} are open, the limit "
                    "(max_http_connections_per_address)")
        self._open[address] = held + 1
        self.count += 1
        return _Ticket(self, address)

    def release(self, address: str) -> None:
        left = self._open.get(address, 0) - 1
        if left > 0:
            self._open[address] = left
        else:
            self._open.pop(address, None)
        self.count -= 1

    def open_from(self, address: str) -> int:
        """Connections open now from ``address``."""
        return self._open.get(address, 0)


class GatedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol that closes a connection whose request head is late
    and gives its ticket back when it closes."""

    ticket: _Ticket | None = None
    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)
        if self.ticket is not None:
            self.ticket.release()

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_late)

    def _header_late(self) -> None:
        # No request in flight: none began since the last response (or the connect).
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            self.transport.abort()


class GatedListener:
    """Accepts HTTP connections on ``sock`` within ``gate``; what uvicorn's
    ``Server.servers`` holds in place of an ``asyncio.Server``.

    Args:
        sock: A bound socket; the listener makes it listen.
        protocol: Makes the protocol of a connection, given its ticket.
        ssl_context: TLS, or None for plaintext.
        gate: The connection caps.
        refusals: Where refused connections are told, rate-limited.
        handshake_timeout_s: The TLS handshake deadline.
    """

    def __init__(self, sock: socket.socket, protocol: Callable[[_Ticket], asyncio.Protocol],
                 ssl_context: ssl.SSLContext | None, gate: ConnectionGate,
                 refusals: RefusalLog, handshake_timeout_s: float) -> None:
        self._sock = sock
        self._protocol = protocol
        self._ssl = ssl_context
        self._gate = gate
        self._refusals = refusals
        self._handshake_timeout_s = handshake_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._resume: asyncio.TimerHandle | None = None
        self._handshakes: set[asyncio.Task[Any]] = set()
        self._closed = False

    def start(self, backlog: int = 2048) -> None:
        """Starts accepting on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._sock.setblocking(False)
        self._sock.listen(backlog)
        self._loop.add_reader(self._sock.fileno(), self._accept)

    def _accept(self) -> None:
        assert self._loop is not None
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                conn, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                self._refusals.refused(("http-accept", exc.errno), (
                    f"hora-coordinator: HTTP accept failed ({exc.strerror}); accepting "
                    f"again in {_ACCEPT_PAUSE_S} s"))
                self._pause()
                return
            ticket = self._gate.admit(addr[0])
            if isinstance(ticket, str):
                conn.close()
                self._refusals.refused("http-connection-cap",
                                       f"hora-coordinator: HTTP connection refused: {ticket}")
                continue
            task = self._loop.create_task(self._connect(conn, ticket))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    def _pause(self) -> None:
        assert self._loop is not None
        self._loop.remove_reader(self._sock.fileno())
        self._resume = self._loop.call_later(_ACCEPT_PAUSE_S, self._unpause)

    def _unpause(self) -> None:
        self._resume = None
        if not self._closed and self._loop is not None:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    async def _connect(self, conn: socket.socket, ticket: _Ticket) -> None:
        assert self._loop is not None
        conn.setblocking(False)
        try:
            await self._loop.connect_accepted_socket(
                lambda: self._protocol(ticket), conn, ssl=self._ssl,
                ssl_handshake_timeout=None if self._ssl is None else self._handshake_timeout_s)
        except (OSError, ssl.SSLError, asyncio.TimeoutError, EOFError) as exc:
            ticket.release()
            conn.close()
            self._refusals.refused("http-handshake", (
                f"hora-coordinator: HTTP connection from {ticket.address} closed during "
                f"its TLS handshake: {type(exc).__name__}"))

    def close(self) -> None:
        """Stops accepting (the socket stays open: its owner closes it)."""
        if self._closed:
            return
        self._closed = True
        if self._resume is not None:
            self._resume.cancel()
        if self._loop is not None and self._sock.fileno() >= 0:
            self._loop.remove_reader(self._sock.fileno())
        for task in list(self._handshakes):
            task.cancel()

    async def wait_closed(self) -> None:
        """Nothing to wait for: open connections belong to uvicorn's shutdown."""


class _RateLimited(logging.Filter):
    """Lets one record per (logger, message) through per interval, the next one
    counting those left out."""

    def __init__(self, refusals: RefusalLog) -> None:
        super().__init__()
        self._refusals = refusals

    def filter(self, record: logging.LogRecord) -> bool:
        left_out = self._refusals.admit((record.name, str(record.msg)))
        if left_out is None:
            return False
        if left_out:
            record.msg = f"{record.getMessage()} ({left_out} more like it since the last such line)"
            record.args = ()
        return True


@contextlib.contextmanager
def rate_limited_loggers(refusals: RefusalLog) -> Iterator[None]:
    """While inside, uvicorn's, asyncio's and gRPC's Python loggers write at most
    one line per message per interval."""
    noisy = [logging.getLogger(name) for name in NOISY_LOGGERS]
    limit = _RateLimited(refusals)
    for log in noisy:
        log.addFilter(limit)
    try:
        yield
    finally:
        for log in noisy:
            log.removeFilter(limit)
