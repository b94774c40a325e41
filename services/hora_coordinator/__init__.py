"""hora's coordinator: rendezvous, store and negotiation over gRPC, job state over HTTP.

Run it as ``hora-coordinator`` (see :mod:`hora_coordinator.__main__`) or embed
it with :class:`EmbeddedCoordinator`. The names below load on first use, so
that a world of one, which only runs the negotiation table
(:mod:`.local`), does not import the servers.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Coordinator",
    "CoordinatorError",
    "CoordinatorSettings",
    "EmbeddedCoordinator",
    "ServingInfo",
    "serve",
]

_WHERE = {
    "Coordinator": ".coordinator",
    "CoordinatorError": ".errors",
    "CoordinatorSettings": ".settings",
    "EmbeddedCoordinator": ".server",
    "ServingInfo": ".server",
    "serve": ".server",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
