"""The REST API needs the job token off loopback, and stays open on loopback.

Off loopback is real: the coordinator binds an address of a network
namespace the test makes (``netns`` fixture), and the HTTP client runs in
that namespace too, so nothing but the test's own address is ever touched.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import httpx
import pytest
from coordinator_clients import Client, new_job_id
from support.rest_probe import PROBE, run_inside

from hora_proto.auth import cookie_value

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]

HERE = Path(__file__).resolve().parent

JOIN = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[3])
    from coordinator_clients import Client
    client = Client(sys.argv[1], sys.argv[2])
    client.join_all(sys.argv[4], 1)
    client.close()
""")


def test_off_loopback_every_route_but_the_probes_needs_the_token(coordinator_factory, netns):
    coordinator = coordinator_factory(host=netns.address, command_prefix=netns.prefix)
    token = coordinator.token
    job = new_job_id()
    run_inside(netns, "-c", JOIN, coordinator.grpc_address, token, str(HERE), job)
    bearer = {"Authorization": f"Bearer {token}"}
    cases = {
        "jobs_bare": ("/api/v1/jobs", {}, {}),
        "job_bare": (f"/api/v1/jobs/{job}", {}, {}),
        "unknown_job_bare": ("/api/v1/jobs/no-such-job", {}, {}),
        "events_bare": (f"/api/v1/jobs/{job}/events", {}, {}),
        "metrics_bare": ("/metrics", {}, {}),
        "jobs_wrong_bearer": ("/api/v1/jobs", {"Authorization": "Bearer nope"}, {}),
        "jobs_wrong_cookie": ("/api/v1/jobs", {}, {"hora_token": "nope"}),
        "jobs_wrong_scheme": ("/api/v1/jobs", {"Authorization": f"Basic {token}"}, {}),
        "jobs_bearer": ("/api/v1/jobs", bearer, {}),
        "job_bearer": (f"/api/v1/jobs/{job}", bearer, {}),
        "events_cookie": (f"/api/v1/jobs/{job}/events", {}, {"hora_token": token}),
        "metrics_bearer": ("/metrics", bearer, {}),
        "jobs_query": (f"/api/v1/jobs?token={token}", {}, {}),
        "healthz_bare": ("/healthz", {}, {}),
        "readyz_bare": ("/readyz", {}, {}),
    }
    seen = json.loads(run_inside(netns, "-c", PROBE, coordinator.http_url, json.dumps(cases)))

    for name in ("jobs_bare", "job_bare", "unknown_job_bare", "events_bare", "metrics_bare",
                 "jobs_wrong_bearer", "jobs_wrong_cookie", "jobs_wrong_scheme"):
        answer = seen[name]
        assert answer["status"] == 401, (name, answer)
        assert answer["www"] == "Bearer", (name, answer)
        body = json.loads(answer["body"])
        assert "Authorization: Bearer" in body["detail"] and "hora_token" in body["detail"]
        # Nothing about the coordinator's jobs: not the job's name, not the token.
        assert job not in answer["body"] and token not in answer["body"], (name, answer)
        assert "no-such-job" not in answer["body"]
    for name in ("jobs_bearer", "job_bearer", "events_cookie", "metrics_bearer", "jobs_query",
                 "healthz_bare", "readyz_bare"):
        assert seen[name]["status"] == 200, (name, seen[name])
    assert job in seen["jobs_bearer"]["body"] and job in seen["job_bearer"]["body"]
    assert "hora_jobs" in seen["metrics_bearer"]["body"]
    # A browser that opened the URL with ?token= keeps the cookie for the next pages.
    cookie = seen["jobs_query"]["set_cookie"]
    # It holds a value derived from the token (issue 25), never the token itself.
    assert cookie.startswith(f"hora_token={cookie_value(token, None)};"), cookie
    assert token not in cookie and "HttpOnly" in cookie, cookie
    assert "samesite=strict" in cookie.lower()
    assert seen["jobs_bearer"]["set_cookie"] == ""


def test_on_loopback_the_api_stays_open(coordinator):
    client = Client(coordinator.grpc_address, coordinator.token)
    try:
        job = new_job_id()
        client.join_all(job, 1)
    finally:
        client.close()
    for path in ("/api/v1/jobs", f"/api/v1/jobs/{job}", f"/api/v1/jobs/{job}/events",
                 "/metrics", "/healthz", "/readyz"):
        assert httpx.get(coordinator.http_url + path, timeout=5).status_code == 200, path
