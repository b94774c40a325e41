"""The one door from the trainer library into the coordinator service.

``horarun`` runs a coordinator in a thread of its own process. Nothing else in
``hora`` imports ``hora_coordinator``; a test checks that this stays so. (A
script started without it is a world of one, whose collectives the negotiation
table answers in process: ``hora._solo`` imports the table's own package,
``hora_negotiation``, not the service.)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Protocol

from hora_proto.auth import WEAK_TOKEN_BITS, token_bits

__all__ = ["RunningCoordinator", "start_embedded_coordinator"]


class RunningCoordinator(Protocol):
    """What the launcher needs of a coordinator it started."""

    @property
    def grpc_address(self) -> str: ...

    @property
    def http_port(self) -> int: ...

    def stop(self) -> None: ...


def start_embedded_coordinator(host: str, token: str, http_port: int = 0,
                               tls: tuple[Path, Path] | None = None) -> RunningCoordinator:
    """Starts a coordinator serving gRPC on an ephemeral port of ``host``; blocks
    until it accepts connections.

    Args:
        host: Address to bind.
        token: The job token.
        http_port: HTTP port (0: ephemeral).
        tls: The certificate and key files to serve TLS with; None for plaintext.

    Raises:
        RuntimeError: it failed to start.
    """
    # Imported here, not at module level: a broken coordinator must not stop
    # `horarun --coordinator HOST:PORT`, nor hide a launcher bug.
    from hora_coordinator.server import EmbeddedCoordinator
    from hora_coordinator.settings import CoordinatorSettings

    # TLS fields only when asked: settings without them are the plaintext default.
    files: dict[str, Any] = {} if tls is None else {"tls_cert": tls[0], "tls_key": tls[1]}
    # The launcher's workers get job tokens derived from this one; a weak one the
    # user chose is warned about (hora-coordinator itself refuses it off loopback).
    if token_bits(token) < WEAK_TOKEN_BITS:
        print(f"horarun: warning: the token has about {token_bits(token):.0f} bits of "
              f"entropy, under {WEAK_TOKEN_BITS}: it can be guessed; use a random one "
              f"(e.g. `openssl rand -hex 16`), or give none and horarun makes one up",
              file=sys.stderr, flush=True)
    coordinator = EmbeddedCoordinator(CoordinatorSettings(
        host=host, grpc_port=0, http_port=http_port, token=token, **files))
    coordinator.start()
    return coordinator
