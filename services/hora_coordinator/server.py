"""Running the coordinator: gRPC and HTTP servers on one event loop.

:func:`serve` runs until its stop event is set. :class:`EmbeddedCoordinator`
runs the same thing in a daemon thread with its own loop; the launcher
``horarun`` embeds a coordinator this way.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hora_proto.refusals import RefusalLog

from .auth import TokenAuthInterceptor
from .connections import (
    ConnectionGate,
    GatedH11Protocol,
    GatedListener,
    grpc_connection_options,
    rate_limited_loggers,
)
from .coordinator import Coordinator
from .gctame import tame_gc
from .guessing import GuessLimiter
from .http import create_app
from .journal import open_journal
from .servicer import add_servicers
from .settings import CoordinatorSettings
from .tls import load_server_tls

__all__ = ["EmbeddedCoordinator", "ServingInfo", "create_grpc_server", "format_address", "serve"]

logger = logging.getLogger("hora_coordinator")

_SERVICE_NAMES = ("hora.v1.Rendezvous", "hora.v1.Store", "hora.v1.Negotiation")


@dataclass(frozen=True)
class ServingInfo:
    """Where a started coordinator listens.

    Attributes:
        host: Bound address.
        grpc_port: Bound gRPC port.
        http_port: Bound HTTP port.
        token: The job token calls must carry.
        pid: The serving process.
        tls: Whether both servers serve TLS.
    """

    host: str
    grpc_port: int
    http_port: int
    token: str
    pid: int
    tls: bool = False

    @property
    def grpc_address(self) -> str:
        """``HOST:PORT`` for gRPC channels."""
        return format_address(self.host, self.grpc_port)

    @property
    def http_url(self) -> str:
        """``http://HOST:PORT`` of the HTTP API (``https://`` with TLS)."""
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{format_address(self.host, self.http_port)}"


def format_address(host: str, port: int) -> str:
    """``host:port``, with IPv6 hosts bracketed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def create_grpc_server(
    coordinator: Coordinator,
    address: str,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int]:
    """A gRPC server for ``coordinator`` bound to ``address`` (port 0: a free one).

    With ``credentials`` the port serves TLS only; plaintext otherwise.

    Returns:
        The server (not started) and its bound port.

    Raises:
        RuntimeError: the address cannot be bound.
    """
    settings = coordinator.settings
    refusals = RefusalLog(settings.refusal_log_interval.total_seconds(), logger)
    # Every rank of a job calls at once (Join, then the store, then its stream):
    # gRPC core refuses calls that wait for the event loop to take them past
    # 1,000 (RESOURCE_EXHAUSTED, "too many pending requests"), which failed 1,000-
    # and 10,000-worker starts (bench/README.md). Let a whole job's burst wait.
    pending = 2 * settings.max_members_per_job
    server = grpc.aio.server(
        interceptors=[TokenAuthInterceptor(
            settings.token, refusals, GuessLimiter(settings.guess_burst, settings.guess_rate))],
        options=[
            ("grpc.so_reuseport", 0),
            # Deliberate, not gRPC's default by chance: a larger request is
            # RESOURCE_EXHAUSTED before any handler runs (settings.max_message_bytes).
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            # Workers ping every 10 s (keepalive) also while a call waits without
            # data, e.g. a Join gathering an elastic round; gRPC's server default
            # (one ping per 5 min) answers that with GOAWAY "too_many_pings".
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.server.max_pending_requests", pending),
            ("grpc.server.max_pending_requests_hard_limit", pending),
            # Connections in total, the handshake deadline, idle ones closed (issue 25).
            *grpc_connection_options(settings),
        ],
    )
    add_servicers(server, coordinator)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.health_servicer = health_servicer
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot bind gRPC to {address} (in use?): {exc}") from exc
    # A listener only this process knows, for the self-check that times the
    # queue of calls waiting to be taken (Coordinator.measure_backlog).
    server.self_check_address = f"unix-abstract:hora-coordinator-{os.getpid()}-{id(server)}"
    server.add_insecure_port(server.self_check_address)
    return server, port


class _UvicornServer(uvicorn.Server):
    """uvicorn, accepting through :class:`~.connections.GatedListener`: capped
    connections, late request heads closed."""

    def __init__(self, config: uvicorn.Config, settings: CoordinatorSettings,
                 refusals: RefusalLog) -> None:
        super().__init__(config)
        self._gate = ConnectionGate(settings.max_http_connections,
                                    settings.max_http_connections_per_address)
        self._header_timeout_s = settings.header_timeout.total_seconds()
        self._refusals = refusals

    # The caller owns signals; uvicorn must neither catch nor re-raise them.
    def capture_signals(self):
        return contextlib.nullcontext()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        config = self.config

        def protocol(ticket: object) -> GatedH11Protocol:
            made = GatedH11Protocol(config=config, server_state=self.server_state,
                                    app_state=self.lifespan.state)
            made.ticket = ticket  # type: ignore[assignment]
            made.header_timeout_s = self._header_timeout_s
            return made

        listeners = []
        for sock in sockets or ():
            listener = GatedListener(sock, protocol, config.ssl, self._gate, self._refusals,
                                     self._header_timeout_s)
            listener.start(config.backlog)
            listeners.append(listener)
        self.servers = listeners  # type: ignore[assignment]
        self.started = True


async def _set_health(server: grpc.aio.Server, serving: bool) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", *_SERVICE_NAMES):
        await server.health_servicer.set(name, status)


async def serve(
    settings: CoordinatorSettings,
    ready: Callable[[ServingInfo], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serves until ``stop`` is set (forever if None).

    Args:
        settings: Settings; an empty token is replaced by a random one.
        ready: Called once, on the loop, when both servers accept connections.
        stop: Set it to shut down cleanly.

    Raises:
        RuntimeError: a port cannot be bound, the TLS files are unusable
            (:class:`~.tls.TLSConfigError`) or the HTTP server did not start.
    """
    settings = settings.with_token()
    tls = load_server_tls(settings)
    stop = stop or asyncio.Event()
    journal = open_journal(settings.state_dir)
    coordinator = Coordinator(settings, journal=journal)
    grpc_server, grpc_port = create_grpc_server(
        coordinator,
        format_address(settings.host, settings.grpc_port),
        None if tls is None else tls.grpc_credentials(),
    )
    sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((settings.host, settings.http_port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(
            f"cannot bind HTTP to {settings.host}:{settings.http_port}: {exc}"
        ) from exc
    http_port = sock.getsockname()[1]
    app = create_app(coordinator)
    refusals = RefusalLog(settings.refusal_log_interval.total_seconds(), logger)
    http = _UvicornServer(
        uvicorn.Config(
            app,
            http=GatedH11Protocol,
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            ssl_certfile=None if tls is None else tls.cert_file,
            ssl_keyfile=None if tls is None else tls.key_file,
            timeout_keep_alive=5,
        ),
        settings,
        refusals,
    )
    await grpc_server.start()
    http_task = asyncio.create_task(http.serve(sockets=[sock]))
    quiet = contextlib.ExitStack()
    quiet.enter_context(rate_limited_loggers(refusals))
    checks: asyncio.Task[None] | None = None
    backlog: asyncio.Task[None] | None = None
    gc_task: asyncio.Task[None] | None = None
    self_check: grpc.aio.Channel | None = None
    try:
        while not http.started:
            if http_task.done():
                raise RuntimeError("the HTTP server did not start") from http_task.exception()
            await asyncio.sleep(0.005)
        await _set_health(grpc_server, True)
        coordinator.serving = True
        checks = asyncio.create_task(coordinator.run_checks())
        self_check = grpc.aio.insecure_channel(grpc_server.self_check_address)
        health_stub = health_pb2_grpc.HealthStub(self_check)
        gc_task = asyncio.create_task(tame_gc())
        backlog = asyncio.create_task(coordinator.measure_backlog(
            lambda: health_stub.Check(health_pb2.HealthCheckRequest(), timeout=60)))
        info = ServingInfo(
            settings.host, grpc_port, http_port, settings.token, os.getpid(), tls is not None
        )
        logger.info("hora-coordinator: gRPC on %s, HTTP on %s, dashboard %s/",
                    info.grpc_address, info.http_url, info.http_url)
        if ready is not None:
            ready(info)
        await stop.wait()
    finally:
        coordinator.serving = False
        if checks is not None:
            checks.cancel()
        if backlog is not None:
            backlog.cancel()
        if gc_task is not None:
            gc_task.cancel()
            gc.unfreeze()
        if self_check is not None:
            await self_check.close()
        coordinator.end_streams()
        await grpc_server.stop(grace=1.0)
        http.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(http_task, timeout=5.0)
        sock.close()
        app.state.renderer.close()
        journal.close()
        quiet.close()
        logger.info("hora-coordinator: stopped")


class EmbeddedCoordinator:
    """A coordinator serving from a daemon thread of this process.

    Example::

        c = EmbeddedCoordinator(CoordinatorSettings(lease=timedelta(seconds=5)))
        c.start()                 # blocks until serving
        channel = grpc.insecure_channel(c.grpc_address)
        ...
        c.stop()

    Args:
        settings: Settings; an empty token is replaced by a random one now,
            so ``token`` is known before ``start``.
    """

    def __init__(self, settings: CoordinatorSettings | None = None) -> None:
        self.settings = (settings or CoordinatorSettings()).with_token()
        self._info: ServingInfo | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    def start(self, timeout: float = 30.0) -> EmbeddedCoordinator:
        """Starts serving and blocks until both servers accept connections.

        Raises:
            RuntimeError: it failed to start, or did not within ``timeout`` seconds.
        """
        if self._thread is not None:
            raise RuntimeError("EmbeddedCoordinator already started")
        self._thread = threading.Thread(target=self._run, name="hora-coordinator", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"the embedded coordinator did not start within {timeout} s")
        if self._info is None:
            raise RuntimeError(
                f"the embedded coordinator failed to start: {self._error}"
            ) from self._error
        return self

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await serve(self.settings, self._on_ready, self._stop)

        try:
            asyncio.run(main())
        except BaseException as exc:
            self._error = exc
            if self._info is not None:  # before serving, start() raises it instead
                logger.exception("embedded coordinator stopped with an error")
        finally:
            self._ready.set()

    def _on_ready(self, info: ServingInfo) -> None:
        self._info = info
        self._ready.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops serving and waits for the thread (idempotent)."""
        loop, stop, thread = self._loop, self._stop, self._thread
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stop.set)
        if thread is not None:
            thread.join(timeout)

    def __enter__(self) -> EmbeddedCoordinator:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _serving(self) -> ServingInfo:
        if self._info is None:
            raise RuntimeError("EmbeddedCoordinator is not started")
        return self._info

    @property
    def grpc_port(self) -> int:
        """Bound gRPC port."""
        return self._serving().grpc_port

    @property
    def http_port(self) -> int:
        """Bound HTTP port."""
        return self._serving().http_port

    @property
    def grpc_address(self) -> str:
        """``HOST:PORT`` for gRPC channels, e.g. ``127.0.0.1:50051``."""
        return self._serving().grpc_address

    @property
    def http_url(self) -> str:
        """``http://HOST:PORT`` of the HTTP API."""
        return self._serving().http_url

    @property
    def token(self) -> str:
        """The job token every gRPC call must carry."""
        return self.settings.token
