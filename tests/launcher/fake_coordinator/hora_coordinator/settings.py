"""The embedding API's settings, as the real coordinator declares them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CoordinatorSettings:
    """The fields ``horarun`` sets."""

    host: str = "127.0.0.1"
    grpc_port: int = 0
    http_port: int = 0
    token: str = ""
