"""The tokens on the HTTP API, once the coordinator is reachable off this machine.

On a loopback address only this machine's users reach the API, as before,
and it stays open. On any other address every path but the health probes
(``/healthz``, ``/readyz``, which say nothing about jobs) wants the admin
token (everything) or a job token (that job only: :func:`job_path_allowed`;
the job list shows it alone, other paths are 403), as one of:

- the header ``Authorization: Bearer <token>`` (scripts, Prometheus);
- the cookie ``hora_token`` (a browser): the value this guard set, derived
  from the token (:func:`hora_proto.auth.cookie_value`), or a token set by hand;
- the query ``?token=<token>``, the URL a coordinator prints when it made its
  token up; the answer sets the cookie, so the next pages need no query.

Anything else is a 401 whose body says how to send the token and nothing
about the coordinator's jobs: the check runs before any route, so not even
"no such job" leaks. Tokens are compared in constant time. The guard is an
ASGI middleware, not a per-route dependency, so that a route added later is
guarded without anyone remembering to.

A person in a browser gets a login form instead of the JSON refusal: a
``GET`` (or ``HEAD``) of a page (any path but the API's, ``/metrics`` and
``/openapi.json``) whose ``Accept`` names ``text/html`` is answered 401
with a small form and nothing else. It posts the token to ``POST /login``
(form field ``token``, and ``next``, the page asked for): the right token
gets the cookie (``HttpOnly``, ``SameSite=Strict``, ``Secure`` under TLS)
and a 303 back to that page, which must be a path of this server (no open
redirect); a wrong one gets the form again, 401, saying so.
"""

from __future__ import annotations

import asyncio
import html
import ipaddress
import json
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import parse_qs, quote, urlencode, urlsplit

from hora_proto.auth import cookie_value, job_of_cookie, job_of_token

from .guessing import GuessLimiter

__all__ = ["COOKIE_NAME", "LOGIN_PATH", "OPEN_PATHS", "SCOPE_JOB_KEY", "TokenGuard",
           "is_loopback", "job_path_allowed", "safe_next"]

COOKIE_NAME = "hora_token"
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
#: Where the login form posts the token.
LOGIN_PATH = "/login"
# Paths that are never a page: their refusal stays JSON whatever the client accepts.
_NOT_PAGES = ("/api/", "/metrics", "/openapi.json")
# A login form's body is one token and one path: anything longer is refused unread,
# and it comes at once or not at all.
_LOGIN_BODY_LIMIT = 8192
_LOGIN_BODY_DEADLINE_S = 10.0
_FORM_HEADERS = [
    (b"content-type", b"text/html; charset=utf-8"),
    (b"cache-control", b"no-store"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"content-security-policy", b"default-src 'none'; style-src 'unsafe-inline'; "
     b"form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
]
_FORM = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>hora &middot; job token</title>
<style>
body{{margin:0;font:15px system-ui,-apple-system,"Segoe UI",Roboto,Arial,sans-serif;
background:#f4f5f7;color:#1f2933}}
main{{max-width:420px;margin:12vh auto;background:#fff;border:1px solid #e3e6ea;
border-radius:10px;padding:28px 30px}}
h1{{margin:0 0 6px;font-size:22px}}p{{color:#4b5563;line-height:1.45}}
label{{display:block;font-size:13px;color:#6b7683;margin:16px 0 6px}}
input[type=password]{{width:100%;box-sizing:border-box;font:inherit;padding:8px 10px;
border:1px solid #cbd2da;border-radius:6px}}
button{{margin-top:16px;font:inherit;font-weight:600;padding:8px 16px;border:0;
border-radius:6px;background:#2563eb;color:#fff;cursor:pointer}}
.wrong{{color:#c81e1e;font-weight:600}}.hint{{font-size:13px}}
</style></head>
<body><main>
<h1>hora</h1>
<p>This coordinator's dashboard and API want the job token.</p>
{wrong}<form method="post" action="{action}">
<input type="hidden" name="next" value="{next}">
<label for="token">Job token</label>
<input id="token" name="token" type="password" autocomplete="current-password" required autofocus>
<button type="submit">Open the dashboard</button>
</form>
<p class="hint">It is the token the job's workers use (<code>HORA_TOKEN</code>);
<code>horarun</code> and <code>hora-coordinator</code> print it when they make one up.
This browser keeps it in a cookie for this site only.</p>
</main></body></html>
"""

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


def safe_next(target: str) -> str:
    """``target`` if it is a path of this server, else ``/``: a login never sends
    the browser elsewhere (``//host``, ``/\\host``, ``https://...`` are refused)."""
    if (not target.startswith("/") or target.startswith("//") or "\\" in target
            or len(target) > 2048 or any(ord(c) < 0x20 or ord(c) == 0x7F for c in target)):
        return "/"
    parts = urlsplit(target)
    return target if not parts.scheme and not parts.netloc else "/"


def _matches(sent: str | None, token: bytes) -> bool:
    return sent is not None and secrets.compare_digest(sent.encode("utf-8", "replace"), token)


#: The ASGI scope key that holds the job a job token limits the request to.
SCOPE_JOB_KEY = "hora.job"
_ADMIN: tuple[bool, str | None] = (True, None)
_NOBODY: tuple[bool, str | None] = (False, None)


def job_path_allowed(path: str, job: str) -> bool:
    """Whether a caller holding job ``job``'s token may ask for ``path``: that job's
    API and page, the job list (filtered to it), the dashboard's static files."""
    parts = path.split("/")
    if path == "/api/v1/jobs" or path.startswith("/static/"):
        return True
    if parts[1:4] == ["api", "v1", "jobs"] and len(parts) > 4:
        return parts[4] == job
    return len(parts) == 3 and parts[1] == "jobs" and parts[2] == job


class TokenGuard:
    """ASGI middleware: refuses requests off :data:`OPEN_PATHS` without a token.

    The admin token opens everything; a job token (:func:`hora_proto.auth.job_token`)
    opens its job's paths only (:func:`job_path_allowed`; others are 403, and ``/``
    goes to the job's page). The cookie it sets holds a value derived from the
    token (:func:`hora_proto.auth.cookie_value`), never the token.

    Args:
        app: The application it guards.
        token: The admin token.
        secure_cookie: Mark the cookie it sets ``Secure`` (the API serves TLS).
        limiter: The wrong-token budget per client address (:mod:`.guessing`).
    """

    def __init__(self, app: ASGIApp, token: str, secure_cookie: bool = False,
                 limiter: GuessLimiter | None = None) -> None:
        self.app = app
        self._admin = token
        self._token = token.encode("utf-8")
        self._secure = secure_cookie
        self._limiter = limiter if limiter is not None else GuessLimiter()

    def _cookie(self, job: str | None) -> bytes:
        return (
            f"{COOKIE_NAME}={cookie_value(self._admin, job)}; Path=/; HttpOnly; SameSite=Strict"
            + ("; Secure" if self._secure else "")
        ).encode("latin-1")

    def _token_caller(self, sent: str) -> tuple[bool, str | None]:
        """``(valid, job)`` of a token: job None for the admin token."""
        if _matches(sent, self._token):
            return _ADMIN
        job = job_of_token(self._admin, sent)
        return (True, job) if job is not None else _NOBODY

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        client = scope.get("client") or ("", 0)
        address, connection = str(client[0]), f"{client[0]}:{client[1]}"
        if not self._limiter.admits(address, connection):
            await _plain(send, 429, b"too many wrong tokens from this address: retry later")
            return
        if scope["type"] == "http" and scope["path"] == LOGIN_PATH and scope["method"] == "POST":
            await self._login(scope, receive, send, address, connection)
            return
        headers: dict[bytes, list[bytes]] = {}
        for name, value in scope.get("headers", ()):
            headers.setdefault(name.lower(), []).append(value)
        sent_any, caller = self._caller(headers)
        if not caller[0]:
            query_sent = parse_qs(scope.get("query_string", b"").decode("latin-1")).get(
                _QUERY_NAME, [])
            sent_any = sent_any or bool(query_sent)
            for value in query_sent:
                caller = self._token_caller(value)
                if caller[0]:
                    send = self._setting_cookie(send, caller[1])
                    break
        if caller[0]:
            self._limiter.proved(connection)
            await self._scoped(scope, receive, send, caller[1])
            return
        if sent_any:
            self._limiter.failed(address, connection)
        if _wants_page(scope, headers):
            await self._send_form(scope, send, _asked_for(scope), wrong=False)
            return
        await self._refuse(scope, send)

    def _caller(self, headers: dict[bytes, list[bytes]]) -> tuple[bool, tuple[bool, str | None]]:
        """Whether any credential came in a header or cookie, and the caller it proves."""
        sent_any = False
        for value in headers.get(b"authorization", ()):
            scheme, _, sent = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                sent_any = True
                caller = self._token_caller(sent.strip())
                if caller[0]:
                    return True, caller
        for value in headers.get(b"cookie", ()):
            cookies: SimpleCookie = SimpleCookie()
            try:
                cookies.load(value.decode("latin-1"))
            except CookieError:  # a malformed Cookie header is just no token
                continue
            morsel = cookies.get(COOKIE_NAME)
            if morsel is None:
                continue
            sent_any = True
            valid, job = job_of_cookie(self._admin, morsel.value)
            if valid:
                return True, (True, job)
            caller = self._token_caller(morsel.value)  # a token set by hand, as before
            if caller[0]:
                return True, caller
        return sent_any, _NOBODY

    async def _scoped(self, scope: Scope, receive: Receive, send: Send, job: str | None) -> None:
        """Serves a request of the admin (``job`` None) or of job ``job``'s token holder."""
        if job is None:
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if job_path_allowed(path, job):
            scope[SCOPE_JOB_KEY] = job
            await self.app(scope, receive, send)
            return
        if path == "/" and scope["type"] == "http":
            target = scope.get("root_path", "") + "/jobs/" + quote(job, safe="")
            await send({"type": "http.response.start", "status": 303, "headers": [
                (b"location", target.encode("latin-1", "replace")),
                (b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"detail": f"this job token opens job {job!r} only"}).encode()
        await send({"type": "http.response.start", "status": 403, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def _setting_cookie(self, send: Send, job: str | None) -> Send:
        cookie = self._cookie(job)

        async def send_with_cookie(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"set-cookie", cookie)]
            await send(message)

        return send_with_cookie

    async def _login(self, scope: Scope, receive: Receive, send: Send, address: str,
                     connection: str) -> None:
        """``POST /login``: the form's token, checked; the cookie and a 303 back, or the
        form again (401)."""
        body = bytearray()
        more = True
        until = asyncio.get_running_loop().time() + _LOGIN_BODY_DEADLINE_S
        while more:
            left = until - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(0.0, left))
            except asyncio.TimeoutError:
                await _plain(send, 408, b"login form not received in time")
                return
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > _LOGIN_BODY_LIMIT:
                await _plain(send, 413, b"login form too large")
                return
        fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
        target = safe_next((fields.get("next") or ["/"])[0])
        sent = (fields.get("token") or [""])[0].strip()
        valid, job = self._token_caller(sent)
        if not valid:
            self._limiter.failed(address, connection)
            await self._send_form(scope, send, target, wrong=True)
            return
        self._limiter.proved(connection)
        if job is not None and not job_path_allowed(urlsplit(target).path, job):
            target = scope.get("root_path", "") + "/jobs/" + quote(job, safe="")
        await send({"type": "http.response.start", "status": 303, "headers": [
            (b"location", target.encode("latin-1", "replace")),
            (b"set-cookie", self._cookie(job)),
            (b"cache-control", b"no-store"),
            (b"content-length", b"0"),
        ]})
        await send({"type": "http.response.body", "body": b""})

    async def _send_form(self, scope: Scope, send: Send, target: str, wrong: bool) -> None:
        """The login form, 401; it says nothing of the coordinator's jobs."""
        page = _FORM.format(
            wrong='<p class="wrong" role="alert">Wrong token.</p>\n' if wrong else "",
            action=html.escape(scope.get("root_path", "") + LOGIN_PATH, quote=True),
            next=html.escape(target, quote=True),
        ).encode("utf-8")
        await send({"type": "http.response.start", "status": 401, "headers": [
            *_FORM_HEADERS,
            (b"content-length", str(len(page)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]})
        await send({"type": "http.response.body",
                    "body": b"" if scope["method"] == "HEAD" else page})

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


def _wants_page(scope: Scope, headers: dict[bytes, list[bytes]]) -> bool:
    """A browser asking for a page: it gets the login form rather than JSON."""
    if scope["type"] != "http" or scope["method"] not in ("GET", "HEAD"):
        return False
    if scope["path"].startswith(_NOT_PAGES):
        return False
    return any(b"text/html" in value.lower() for value in headers.get(b"accept", ()))


def _asked_for(scope: Scope) -> str:
    """The path and query the browser asked for, less any ``token``, to go back to."""
    query = [(k, v) for k, v in parse_qs(scope.get("query_string", b"").decode("latin-1"),
                                          keep_blank_values=True).items() if k != _QUERY_NAME]
    flat = [(k, item) for k, values in query for item in values]
    path = scope.get("root_path", "") + scope["path"]
    return safe_next(path + ("?" + urlencode(flat) if flat else ""))


async def _plain(send: Send, status: int, text: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(text)).encode()),
    ]})
    await send({"type": "http.response.body", "body": text})
