"""The login form off loopback, over real HTTP inside a network namespace of the test's.

A browser asking for a page without the token gets a form (401) that says
nothing about the jobs; ``POST /login`` with the right token sets the cookie
and sends it back to the page it asked for, never elsewhere; the API and
its streams keep their JSON refusal. The coordinator binds an address of the
namespace (``netns`` fixture) and the client runs inside it, as in
``test_rest_token.py``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from coordinator_clients import new_job_id

from hora_coordinator.rest_auth import TokenGuard, safe_next
from hora_proto.auth import cookie_value

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]

HERE = Path(__file__).resolve().parent
HTML = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}

# Runs inside the namespace: one request per case (no redirects followed), as JSON.
PROBE = textwrap.dedent("""
    import json, sys
    import httpx
    url, cases = sys.argv[1], json.loads(sys.argv[2])
    out = {}
    for name, case in cases.items():
        with httpx.Client(base_url=url, timeout=5, cookies=case.get("cookies") or {},
                          follow_redirects=False) as client:
            answer = client.request(case["method"], case["path"], headers=case.get("headers"),
                                    data=case.get("data"), content=case.get("content"))
        out[name] = {"status": answer.status_code, "body": answer.text,
                     "type": answer.headers.get("content-type", ""),
                     "location": answer.headers.get("location"),
                     "www": answer.headers.get("www-authenticate", ""),
                     "csp": answer.headers.get("content-security-policy", ""),
                     "set_cookie": answer.headers.get("set-cookie", "")}
    print(json.dumps(out))
""")

JOIN = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[3])
    from coordinator_clients import Client
    client = Client(sys.argv[1], sys.argv[2])
    client.join_all(sys.argv[4], 1, hosts=["secret-host"])
    client.close()
""")


def _inside(netns, *argv: str) -> str:
    done = subprocess.run([*netns.prefix, sys.executable, *argv], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _get(path: str, headers: dict | None = None, cookies: dict | None = None,
         method: str = "GET") -> dict:
    return {"method": method, "path": path, "headers": headers or {}, "cookies": cookies}


def _login(token: str, target: str) -> dict:
    return {"method": "POST", "path": "/login", "data": {"token": token, "next": target}}


def test_a_browser_without_the_token_gets_a_login_form_and_nothing_else(coordinator_factory,
                                                                        netns):
    coordinator = coordinator_factory(host=netns.address, command_prefix=netns.prefix)
    token = coordinator.token
    job = new_job_id()
    _inside(netns, "-c", JOIN, coordinator.grpc_address, token, str(HERE), job)
    cookie = {"hora_token": token}
    cases = {
        "root": _get("/", HTML),
        "job_page": _get(f"/jobs/{job}?token=nope&view=1", HTML),
        "head": _get("/", HTML, method="HEAD"),
        "wrong_cookie_page": _get("/", HTML, {"hora_token": "nope"}),
        "api_html": _get("/api/v1/jobs", HTML),
        "live_html": _get(f"/api/v1/jobs/{job}/live", {"Accept": "text/event-stream"}),
        "metrics_html": _get("/metrics", HTML),
        "openapi_html": _get("/openapi.json", HTML),
        "script_bare": _get("/static/job.js"),
        "wrong": _login("nope", "/"),
        "blank": _login("", "/"),
        "right": _login(token, f"/jobs/{job}"),
        "to_other_host": _login(token, "//evil.example/x"),
        "to_other_scheme": _login(token, "https://evil.example/"),
        "to_backslash": _login(token, "/\\evil.example"),
        "to_script": _login(token, "javascript:alert(1)"),
        "too_large": {"method": "POST", "path": "/login",
                      "content": "token=" + "x" * 10_000,
                      "headers": {"content-type": "application/x-www-form-urlencoded"}},
        "page_with_cookie": _get(f"/jobs/{job}", HTML, cookie),
        "telemetry_with_cookie": _get(f"/api/v1/jobs/{job}/telemetry", cookies=cookie),
    }
    seen = json.loads(_inside(netns, "-c", PROBE, coordinator.http_url, json.dumps(cases)))

    for name in ("root", "job_page", "wrong_cookie_page", "wrong", "blank"):
        answer = seen[name]
        assert answer["status"] == 401, (name, answer)
        assert answer["type"].startswith("text/html"), (name, answer)
        assert answer["www"] == "Bearer"
        body = answer["body"]
        assert '<form method="post" action="/login">' in body, name
        assert 'name="token" type="password"' in body, name
        assert "default-src 'none'" in answer["csp"] and "form-action 'self'" in answer["csp"]
        # Nothing about the coordinator's jobs, and never the token.
        assert token not in body and "secret-host" not in body, name
        assert answer["set_cookie"] == "", name
    for name in ("root", "wrong_cookie_page", "wrong", "blank"):
        assert job not in seen[name]["body"], name
    assert "Wrong token" not in seen["root"]["body"]
    assert "Wrong token" in seen["wrong"]["body"] and "Wrong token" in seen["blank"]["body"]
    # The form goes back to the page asked for, less the token of the query.
    assert f'name="next" value="/jobs/{job}?view=1"' in seen["job_page"]["body"]
    assert "nope" not in seen["job_page"]["body"]
    assert 'name="next" value="/"' in seen["wrong"]["body"]
    assert seen["head"]["status"] == 401 and seen["head"]["body"] == ""

    # The API, its streams and the files keep the JSON refusal, whatever the client accepts.
    for name in ("api_html", "live_html", "metrics_html", "openapi_html", "script_bare"):
        answer = seen[name]
        assert answer["status"] == 401 and answer["type"] == "application/json", (name, answer)
        assert "hora_token" in json.loads(answer["body"])["detail"]

    right = seen["right"]
    assert right["status"] == 303 and right["location"] == f"/jobs/{job}", right
    cookie_line = right["set_cookie"]
    # A value derived from the token (issue 25), never the token itself.
    assert cookie_line.startswith(f"hora_token={cookie_value(token, None)};"), cookie_line
    assert token not in cookie_line
    assert "HttpOnly" in cookie_line and "SameSite=Strict" in cookie_line
    assert "Path=/" in cookie_line and "Secure" not in cookie_line  # plain HTTP here
    for name in ("to_other_host", "to_other_scheme", "to_backslash", "to_script"):
        assert seen[name]["status"] == 303 and seen[name]["location"] == "/", (name, seen[name])
    assert seen["too_large"]["status"] == 413

    assert seen["page_with_cookie"]["status"] == 200
    assert seen["page_with_cookie"]["type"].startswith("text/html")
    assert seen["telemetry_with_cookie"]["status"] == 200
    assert json.loads(seen["telemetry_with_cookie"]["body"])["job_id"] == job


def test_on_loopback_the_pages_stay_open(coordinator):
    for path in ("/", "/jobs/any-job", "/static/common.js"):
        answer = httpx.get(coordinator.http_url + path, headers=HTML, timeout=5)
        assert answer.status_code == 200, path
    # No guard, so no login route either.
    answer = httpx.post(coordinator.http_url + "/login", data={"token": "x"}, timeout=5)
    assert answer.status_code in (404, 405)


@pytest.mark.unit
def test_only_paths_of_this_server_are_targets():
    for target in ("/", "/jobs/a-job", "/jobs/a?x=1", "/%2F%2Fstill-a-path"):
        assert safe_next(target) == target
    for target in ("", "jobs", "//evil.example", "///evil.example", "/\\evil.example",
                   "https://evil.example", "javascript:alert(1)", "/a\nLocation: x",
                   "/" + "a" * 3000):
        assert safe_next(target) == "/", target


@pytest.mark.unit
def test_the_cookie_is_secure_under_tls():
    async def app(scope, receive, send):
        raise AssertionError("the login is answered by the guard")

    guard = TokenGuard(app, token="t0k", secure_cookie=True)
    transport = httpx.ASGITransport(app=guard)

    async def login() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="https://coordinator") as c:
            return await c.post("/login", data={"token": "t0k", "next": "/"})

    answer = asyncio.run(login())
    assert answer.status_code == 303
    assert "Secure" in answer.headers["set-cookie"]
