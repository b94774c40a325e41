"""``horarun --coordinator``: tells the user when the coordinator goes away and comes back.

The workers train on through a coordinator outage and re-attach when it is
back; this watch only reports it on horarun's stderr, from a daemon thread
that asks the coordinator's gRPC health service once a second.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .._tls import coordinator_channel

__all__ = ["CoordinatorWatch"]


class CoordinatorWatch:
    """Polls ``address`` and says when it stops and starts answering.

    Args:
        address: the coordinator's gRPC ``HOST:PORT``.
        say: where the lines go (horarun's stderr).
        tls_ca: CA bundle (path or PEM) of a TLS coordinator; empty for plaintext.
        interval: seconds between probes.
    """

    def __init__(self, address: str, say: Callable[[str], None], tls_ca: str = "",
                 interval: float = 1.0) -> None:
        self._address = address
        self._say = say
        self._interval = interval
        self._stop = threading.Event()
        self._channel = coordinator_channel(address, tls_ca, options=[
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ])
        self._stub = health_pb2_grpc.HealthStub(self._channel)
        self._thread = threading.Thread(target=self._loop, name="horarun-coordinator-watch",
                                        daemon=True)

    def start(self) -> CoordinatorWatch:
        self._thread.start()
        return self

    def _probe(self) -> str:
        """'' when the coordinator serves, else why not."""
        try:
            reply = self._stub.Check(health_pb2.HealthCheckRequest(), timeout=self._interval)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return "not serving"
        return ""

    def _loop(self) -> None:
        seen = False  # it answered once: before that, workers are still connecting
        lost_at: float | None = None
        while not self._stop.wait(self._interval):
            why = self._probe()
            if not why:
                if lost_at is not None:
                    self._say(f"the coordinator {self._address} answers again after "
                              f"{time.monotonic() - lost_at:.1f} s; the workers re-attach to it")
                seen, lost_at = True, None
            elif seen and lost_at is None:
                lost_at = time.monotonic()
                self._say(f"lost the coordinator {self._address} ({why}); the workers "
                          f"train on and re-attach when it is back, for up to "
                          f"HORA_COORDINATOR_OUTAGE_TIMEOUT (60 s by default)")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._interval + 1)
        self._channel.close()
