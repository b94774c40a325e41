"""The job token on the HTTP API, once the coordinator is reachable off this machine.

On a loopback address only this machine's users reach the API, as before,
and it stays open. On any other address every path but the health probes
(``/healthz``, ``/readyz``, which say nothing about jobs) wants the job
token, as one of:

- the header ``Authorization: Bearer <token>`` (scripts, Prometheus);
- the cookie ``hora_token`` (a browser);
- the query ``?token=<token>``, the URL a coordinator prints when it made its
  token up; the answer sets the cookie, so the next pages need no query.

Anything else is a 401 whose body says how to send the token and nothing
about the coordinator's jobs: the check runs before any route, so not even
"no such job" leaks. Tokens are compared in constant time. The guard is an
ASGI middleware, not a per-route dependency, so that a route added later is
guarded without anyone remembering to.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import parse_qs

__all__ = ["COOKIE_NAME", "OPEN_PATHS", "TokenGuard", "is_loopback"]

COOKIE_NAME = "hora_token"
OPEN_PATHS = frozenset({"/healthz", "/readyz"})

_QUERY_NAME = "token"
_REFUSAL = json.dumps(
    {
        "detail": "missing or wrong job token: send it as the header "
        "'Authorization: Bearer <token>' or in the cookie 'hora_token'"
    }
).encode()

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the servers on this machine only.

    Wildcards (``0.0.0.0``, ``::``) and names other than ``localhost`` are not.
    """
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _matches(sent: str | None, token: bytes) -> bool:
    return sent is not None and secrets.compare_digest(sent.encode("utf-8", "replace"), token)


class TokenGuard:
    """ASGI middleware: refuses requests off :data:`OPEN_PATHS` without the token.

    Args:
        app: The application it guards.
        token: The job token.
        secure_cookie: Mark the cookie it sets ``Secure`` (the API serves TLS).
    """

    def __init__(self, app: ASGIApp, token: str, secure_cookie: bool = False) -> None:
        self.app = app
        self._token = token.encode("utf-8")
        self._cookie = (
            f"{COOKIE_NAME}={token}; Path=/; HttpOnly; SameSite=Strict"
            + ("; Secure" if secure_cookie else "")
        ).encode("latin-1")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, list[bytes]] = {}
        for name, value in scope.get("headers", ()):
            headers.setdefault(name.lower(), []).append(value)
        if any(self._bearer_ok(v) for v in headers.get(b"authorization", ())) or any(
            self._cookie_ok(v) for v in headers.get(b"cookie", ())
        ):
            await self.app(scope, receive, send)
            return
        if self._query_ok(scope.get("query_string", b"")):
            await self.app(scope, receive, self._setting_cookie(send))
            return
        await self._refuse(scope, send)

    def _bearer_ok(self, value: bytes) -> bool:
        scheme, _, sent = value.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and _matches(sent.strip(), self._token)

    def _cookie_ok(self, value: bytes) -> bool:
        cookies: SimpleCookie = SimpleCookie()
        try:
            cookies.load(value.decode("latin-1"))
        except CookieError:  # a malformed Cookie header is just no token
            return False
        morsel = cookies.get(COOKIE_NAME)
        return _matches(morsel.value if morsel is not None else None, self._token)

    def _query_ok(self, query: bytes) -> bool:
        sent = parse_qs(query.decode("latin-1")).get(_QUERY_NAME, [])
        return any(_matches(value, self._token) for value in sent)

    def _setting_cookie(self, send: Send) -> Send:
        async def send_with_cookie(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"set-cookie", self._cookie)]
            await send(message)

        return send_with_cookie

    async def _refuse(self, scope: Scope, send: Send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(_REFUSAL)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _REFUSAL})
