"""The one door from the trainer library into the coordinator service.

``horarun`` runs a coordinator in a thread of its own process; a script
started without it is a world of one, whose collectives the coordinator's
negotiation table answers in process, with no server. Nothing else in
``hora`` imports ``hora_coordinator``; a test checks that this stays so.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from hora_proto.auth import WEAK_TOKEN_BITS, token_bits
from hora_proto.v1 import negotiation_pb2

__all__ = ["LocalNegotiation", "RunningCoordinator", "local_negotiation", "refused_call",
           "start_embedded_coordinator"]


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


class LocalNegotiation(Protocol):
    """The coordinator's negotiation for a world of one (see :func:`local_negotiation`).

    Process set calls are decided at once, as the coordinator decides them once
    every rank has called; a refused call raises the coordinator's own error,
    whose message is the one every rank of a larger world would get.
    """

    def add_process_set(self, process_set_id: int, ranks: Sequence[int],
                        invalid: str = "") -> None: ...

    def remove_process_set(self, process_set_id: int, invalid: str = ""
                           ) -> list[negotiation_pb2.CoordinatorMessage]: ...

    def submit(self, requests: Iterable[negotiation_pb2.TensorRequest]
               ) -> list[negotiation_pb2.CoordinatorMessage]: ...


def local_negotiation(fusion_threshold_bytes: int) -> LocalNegotiation:
    """The negotiation table of a world of one, run in this process."""
    from hora_coordinator.local import LocalNegotiation as _Local

    return _Local(fusion_threshold_bytes)


@contextlib.contextmanager
def refused_call() -> Iterator[None]:
    """Turns the local table's refusal of a call into the trainer's InvalidCallError.

    Only a refusal: any other exception is a bug and goes up as it is.
    """
    from hora_coordinator.errors import InvalidRequestError

    from ..errors import InvalidCallError

    try:
        yield
    except InvalidRequestError as exc:
        raise InvalidCallError(str(exc)) from exc
