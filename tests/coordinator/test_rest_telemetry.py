"""The dashboard's data on REST, over real HTTP to a real coordinator process.

Members join over gRPC and their heartbeats carry telemetry, as a worker's
do; the test chooses the figures, so it knows what ``/ranks``,
``/telemetry`` and the live streams must answer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from coordinator_clients import Client, new_job_id

from hora_proto.v1 import rendezvous_pb2 as rpb

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]

# Rank 2 arrives last at most rounds, and late: the straggler.
FIGURES = {
    0: dict(steps=120, last_step_s=0.05, steps_per_s=20.0, batch_size=16, rounds=200,
            lateness_p50_ms=0.3, lateness_p95_ms=1.0, last_arrivals=10, cache_hits=190,
            cache_misses=10),
    1: dict(steps=121, last_step_s=0.05, steps_per_s=20.0, batch_size=16, rounds=200,
            lateness_p50_ms=0.4, lateness_p95_ms=1.5, last_arrivals=12, cache_hits=190,
            cache_misses=10),
    2: dict(steps=119, last_step_s=0.09, steps_per_s=19.0, batch_size=16, rounds=200,
            lateness_p50_ms=30.0, lateness_p95_ms=80.0, last_arrivals=178, cache_hits=190,
            cache_misses=10),
}


@pytest.fixture
def job(coordinator) -> Iterator[tuple[str, dict[int, str], Client]]:
    """A running 3-member job whose members have reported :data:`FIGURES`."""
    client = Client(coordinator.grpc_address, coordinator.token)
    job_id = new_job_id()
    views = client.join_all(job_id, 3, hosts=["host-a", "host-b", "host-c"])
    workers = {m.rank: m.worker_id for m in views[0].members}
    for rank, worker in workers.items():
        client.rendezvous.Heartbeat(
            rpb.HeartbeatRequest(job_id=job_id, worker_id=worker, generation=1,
                                 telemetry=rpb.RankTelemetry(**FIGURES[rank])),
            metadata=client.metadata, timeout=5)
    try:
        yield job_id, workers, client
    finally:
        client.close()


def _get(coordinator, path: str) -> httpx.Response:
    return httpx.get(coordinator.http_url + path, timeout=5)


def test_ranks_show_each_members_figures(coordinator, job):
    job_id, workers, _ = job
    answer = _get(coordinator, f"/api/v1/jobs/{job_id}/ranks")
    assert answer.status_code == 200, answer.text
    ranks = {r["rank"]: r for r in answer.json()}
    assert sorted(ranks) == [0, 1, 2]
    for rank, r in ranks.items():
        figures = FIGURES[rank]
        assert r["worker_id"] == workers[rank]
        assert r["host"] == ["host-a", "host-b", "host-c"][rank] and r["pid"] > 0
        assert r["state"] == "active" and r["cause"] == "" and r["reported"]
        assert 0 <= r["heartbeat_age_s"] < 5 and not r["heartbeat_late"]
        assert (r["steps"], r["last_step_s"], r["steps_per_s"]) == (
            figures["steps"], figures["last_step_s"], figures["steps_per_s"])
        assert r["batch_size"] == 16
        assert r["samples_per_s"] == pytest.approx(16 * figures["steps_per_s"])
        assert (r["rounds"], r["last_arrivals"]) == (200, figures["last_arrivals"])
        assert r["lateness_p95_ms"] == figures["lateness_p95_ms"]
        assert r["last_share"] == pytest.approx(figures["last_arrivals"] / 200)
    assert ranks[2]["straggler"] and not ranks[0]["straggler"] and not ranks[1]["straggler"]


def test_telemetry_names_the_straggler_and_the_cache_use(coordinator, job):
    job_id, _, _ = job
    # The coordinator samples a running job once a second.
    deadline = time.monotonic() + 10
    while True:
        telemetry = _get(coordinator, f"/api/v1/jobs/{job_id}/telemetry").json()
        if telemetry["series"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (telemetry["job_id"], telemetry["state"]) == (job_id, "running")
    assert (telemetry["generation"], telemetry["size"], telemetry["reset_count"]) == (1, 3, 0)
    assert abs(telemetry["unix_ms"] / 1000 - time.time()) < 5
    assert len(telemetry["ranks"]) == 3
    stragglers = telemetry["stragglers"]
    assert (stragglers["slowest_rank"], stragglers["host"]) == (2, "host-c"), stragglers
    assert stragglers["is_straggler"] and stragglers["rounds"] == 200
    assert stragglers["lateness_p95_ms"] == 80.0
    negotiation = telemetry["negotiation"]
    assert (negotiation["cache_hits"], negotiation["cache_misses"]) == (570, 30)
    assert negotiation["cache_hit_ratio"] == pytest.approx(0.95)
    assert [(m["generation"], m["size"], m["reset"]) for m in telemetry["generations"]] == [
        (1, 3, False)]
    assert telemetry["series"], "no sample within 10 s"
    sample = telemetry["series"][-1]
    assert (sample["generation"], sample["size"]) == (1, 3)
    assert sample["steps_per_s"] == 20.0  # the median of the ranks' rates
    assert sample["samples_per_s"] == pytest.approx(16 * (20 + 20 + 19))
    # since_ms: only what is newer.
    later = _get(coordinator, f"/api/v1/jobs/{job_id}/telemetry?since_ms={sample['unix_ms']}")
    assert all(s["unix_ms"] > sample["unix_ms"] for s in later.json()["series"])
    assert later.json()["generations"] == []


def test_unknown_job_is_404_on_every_telemetry_route(coordinator):
    for path in ("/ranks", "/telemetry", "/live"):
        answer = _get(coordinator, f"/api/v1/jobs/no-such-job{path}")
        assert answer.status_code == 404, (path, answer.text)
        assert "no-such-job" in answer.json()["detail"]


class _Sse:
    """Reads server-sent events off a streaming response, each read with a deadline."""

    def __init__(self, response: httpx.Response) -> None:
        self._lines = response.iter_lines()

    def next(self, deadline_s: float = 5.0) -> tuple[str, dict | list]:
        # httpx's read timeout bounds each wait for bytes; this bounds the whole message.
        until = time.monotonic() + deadline_s
        event, data = "", []
        for line in self._lines:
            if time.monotonic() > until:
                break
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                data.append(line[len("data: "):])
            elif line == "" and event:
                return event, json.loads("".join(data))
        raise AssertionError(f"no complete server-sent event within {deadline_s} s")


def test_job_live_stream_starts_with_everything_then_sends_what_is_new(coordinator, job):
    job_id, _, client = job
    timeout = httpx.Timeout(5.0, read=3.0)
    with httpx.stream("GET", f"{coordinator.http_url}/api/v1/jobs/{job_id}/live",
                      timeout=timeout) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-store"
        sse = _Sse(response)
        kind, first = sse.next()
        assert kind == "job" and first["reset"] is True
        assert first["job"]["job_id"] == job_id and len(first["job"]["members"]) == 3
        assert first["telemetry"]["stragglers"]["slowest_rank"] == 2
        kinds = [e["kind"] for e in first["events"]]
        assert kinds.count("join") == 3 and "generation" in kinds
        client.report_event(job_id, "blacklist", "host-x", "blacklisting host-x (test)")
        # Within a few ticks the new event comes, alone, in a message that is not a reset.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            kind, message = sse.next()
            assert kind == "job" and message["reset"] is False
            if message["events"]:
                assert [(e["kind"], e["host"], e["message"]) for e in message["events"]] == [
                    ("blacklist", "host-x", "blacklisting host-x (test)")]
                break
        else:
            raise AssertionError("the reported event never came on the live stream")


def test_jobs_live_stream_sends_the_jobs_list(coordinator, job):
    job_id, _, _ = job
    with httpx.stream("GET", f"{coordinator.http_url}/api/v1/live",
                      timeout=httpx.Timeout(5.0, read=3.0)) as response:
        assert response.status_code == 200
        kind, jobs = _Sse(response).next()
    assert kind == "jobs"
    (summary,) = [j for j in jobs if j["job_id"] == job_id]
    assert summary["state"] == "running" and summary["size"] == 3
    assert summary["steps_per_s"] == 20.0 and summary["age_s"] >= 0
    assert summary["last_event"]["kind"] == "generation"


def test_openapi_lists_the_dashboard_data_routes_and_not_the_pages(coordinator):
    paths = _get(coordinator, "/openapi.json").json()["paths"]
    for path in ("/api/v1/jobs", "/api/v1/jobs/{job_id}", "/api/v1/jobs/{job_id}/events",
                 "/api/v1/jobs/{job_id}/ranks", "/api/v1/jobs/{job_id}/telemetry",
                 "/api/v1/live", "/api/v1/jobs/{job_id}/live"):
        assert "get" in paths.get(path, {}), path
    live = paths["/api/v1/jobs/{job_id}/live"]["get"]["responses"]["200"]["content"]
    assert "text/event-stream" in live
    # The HTML pages and their files are not API.
    assert "/" not in paths and "/jobs/{job_id}" not in paths
    assert not any(p.startswith("/static") for p in paths)


def test_the_pages_and_their_files_are_served_from_the_package(coordinator):
    for path in ("/", "/jobs/some-job"):
        page = _get(coordinator, path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp
        assert "connect-src 'self'" in csp
        # Nothing from elsewhere: every src and href is relative to this server.
        assert "http://" not in page.text and "https://" not in page.text
        assert "some-job" not in page.text  # the script reads the id from its URL
    for name, kind in (("common.js", "text/javascript"), ("job.js", "text/javascript"),
                       ("jobs.js", "text/javascript"), ("dashboard.css", "text/css"),
                       ("favicon.svg", "image/svg+xml")):
        answer = _get(coordinator, f"/static/{name}")
        assert answer.status_code == 200, name
        assert answer.headers["content-type"].startswith(kind), name
        assert "http://" not in answer.text.replace("http://www.w3.org/2000/svg", "")
    assert _get(coordinator, "/static/nope.js").status_code == 404
    assert _get(coordinator, "/static/..%2Fhttp.py").status_code == 404


def test_the_page_scripts_write_server_strings_as_text_only():
    static = Path(__file__).resolve().parents[2] / "services/hora_coordinator/dashboard/static"
    for script in static.glob("*.js"):
        source = script.read_text()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
            assert sink not in source, f"{script.name} uses {sink}"
