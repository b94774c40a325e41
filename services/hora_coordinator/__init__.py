"""hora's coordinator: rendezvous, store and negotiation over gRPC, job state over HTTP.

Run it as ``hora-coordinator`` (see :mod:`hora_coordinator.__main__`) or embed
it with :class:`EmbeddedCoordinator`.
"""

from __future__ import annotations

from .coordinator import Coordinator
from .errors import CoordinatorError
from .server import EmbeddedCoordinator, ServingInfo, serve
from .settings import CoordinatorSettings

__all__ = [
    "Coordinator",
    "CoordinatorError",
    "CoordinatorSettings",
    "EmbeddedCoordinator",
    "ServingInfo",
    "serve",
]
