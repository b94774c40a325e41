"""The ``Host`` check of a coordinator bound to loopback (DNS rebinding).

On loopback the REST API asks no token (:mod:`.rest_auth`): anything on the
machine may read job state. A web page may too, through DNS rebinding: its
own name, re-pointed at 127.0.0.1, makes the browser send our API requests
with the page's name in ``Host``. Refusing every ``Host`` that does not name
loopback closes that door; local tools that use ``localhost`` or the address
are unaffected.
"""

from __future__ import annotations

import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["LoopbackHostGuard", "is_loopback_host"]

_MISDIRECTED = 421


def is_loopback_host(header: str) -> bool:
    """Whether a ``Host`` header value (with or without a port) names loopback."""
    host = header.strip().lower()
    if host.startswith("["):  # [::1]:port
        host = host[1:host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class LoopbackHostGuard:
    """ASGI middleware: 421 for HTTP requests whose ``Host`` is not loopback;
    a request without ``Host`` (HTTP/1.0) passes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"host":
                    if not is_loopback_host(value.decode("latin-1")):
                        await _refuse(send)
                        return
                    break
        await self.app(scope, receive, send)


async def _refuse(send: Send) -> None:
    body = (b'{"detail":"this coordinator serves loopback only: the Host header must be '
            b'localhost or a loopback address"}')
    await send({"type": "http.response.start", "status": _MISDIRECTED,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
