"""An embedded coordinator that only listens, and records that it was stopped.

``FAKE_COORDINATOR_FAIL=1`` makes :meth:`EmbeddedCoordinator.start` raise;
``FAKE_COORDINATOR_STOPPED=PATH`` names a file written by ``stop()``.
"""

from __future__ import annotations

import os
import socket

from .settings import CoordinatorSettings


class EmbeddedCoordinator:
    """Binds real ports so the addresses it reports are genuine."""

    def __init__(self, settings: CoordinatorSettings) -> None:
        self._settings = settings
        self.token = settings.token
        self._sockets: list[socket.socket] = []
        self.grpc_port = 0
        self.http_port = 0

    def _listen(self, port: int) -> int:
        sock = socket.socket()
        sock.bind((self._settings.host, port))
        sock.listen()
        self._sockets.append(sock)
        return sock.getsockname()[1]

    @property
    def grpc_address(self) -> str:
        return f"{self._settings.host}:{self.grpc_port}"

    def start(self) -> None:
        if os.environ.get("FAKE_COORDINATOR_FAIL"):
            raise OSError("address already in use (simulated)")
        self.grpc_port = self._listen(self._settings.grpc_port)
        self.http_port = self._listen(self._settings.http_port)

    def stop(self) -> None:
        for sock in self._sockets:
            sock.close()
        marker = os.environ.get("FAKE_COORDINATOR_STOPPED")
        if marker:
            with open(marker, "w") as f:
                f.write(f"{self.grpc_address} {self.token}")
