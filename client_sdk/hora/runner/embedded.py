"""The one door from the trainer library into the coordinator service.

``horarun`` (and a script started without it, as a world of one) runs a
coordinator in a thread of its own process. Nothing else in ``hora``
imports ``hora_coordinator``; a test checks that this stays so.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["RunningCoordinator", "start_embedded_coordinator"]


class RunningCoordinator(Protocol):
    """What the launcher needs of a coordinator it started."""

    @property
    def grpc_address(self) -> str: ...

    @property
    def http_port(self) -> int: ...

    def stop(self) -> None: ...


def start_embedded_coordinator(host: str, token: str, http_port: int = 0
                               ) -> RunningCoordinator:
    """Starts a coordinator serving gRPC on an ephemeral port of ``host``; blocks
    until it accepts connections.

    Raises:
        RuntimeError: it failed to start.
    """
    # Imported here, not at module level: a broken coordinator must not stop
    # `horarun --coordinator HOST:PORT`, nor hide a launcher bug.
    from hora_coordinator.server import EmbeddedCoordinator
    from hora_coordinator.settings import CoordinatorSettings

    coordinator = EmbeddedCoordinator(CoordinatorSettings(
        host=host, grpc_port=0, http_port=http_port, token=token))
    coordinator.start()
    return coordinator
