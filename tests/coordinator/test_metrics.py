"""GET /metrics: Prometheus text read from the coordinator's job state, over real gRPC."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from coordinator_clients import Client, new_job_id, tensor
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]

MEMBER_STATES = {"joining", "active", "left", "lost"}
JOB_STATES = {"gathering", "running", "finished", "failed"}


def scrape(http: httpx.Client) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Sample name -> {sorted labels: value}, parsed by prometheus-client's own parser."""
    answer = http.get("/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain")
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            samples.setdefault(sample.name, {})[labels] = sample.value
    return samples


def job_value(samples, name: str, job: str, **labels: str) -> float:
    return samples[name][tuple(sorted({"job_id": job, **labels}.items()))]


def members(samples, job: str) -> dict[str, float]:
    return {s: job_value(samples, "hora_job_members", job, state=s) for s in MEMBER_STATES}


def jobs(samples) -> dict[str, float]:
    return {s: samples["hora_jobs"][(("state", s),)] for s in JOB_STATES}


@pytest.fixture
def http(coordinator):
    with httpx.Client(base_url=coordinator.http_url, timeout=5) as client:
        yield client


@pytest.fixture
def client(coordinator):
    c = Client(coordinator.grpc_address, coordinator.token)
    yield c
    c.close()


def test_an_idle_coordinator_exports_every_job_state_at_zero(http):
    samples = scrape(http)
    assert jobs(samples) == dict.fromkeys(JOB_STATES, 0.0)
    for name in (
        "hora_negotiation_messages_total",
        "hora_negotiated_tensors_total",
        "hora_negotiation_errors_total",
        "hora_job_generation",
        "hora_job_members",
    ):
        assert name not in samples  # no job, no series


def test_counters_follow_negotiation_with_job_labels(client, http):
    job = new_job_id()
    views = client.join_all(job, 2, fusion_threshold_bytes=1024)  # x and y in one response
    workers = [m.worker_id for m in views[0].members]
    streams = [client.stream(job, w, 1) for w in workers]
    try:
        for s in streams:
            s.send(tensor("x"), tensor("y"))
        for s in streams:
            assert [list(r.tensor_names) for r in s.responses()] == [["x", "y"]]
        samples = scrape(http)
        assert job_value(samples, "hora_negotiation_messages_total", job) == 2
        assert job_value(samples, "hora_negotiated_tensors_total", job) == 2
        assert job_value(samples, "hora_negotiation_errors_total", job) == 0
        assert job_value(samples, "hora_job_generation", job) == 1
        assert members(samples, job) == {"joining": 0, "active": 2, "left": 0, "lost": 0}
        assert jobs(samples) == {"gathering": 0, "running": 1, "finished": 0, "failed": 0}

        streams[0].send(tensor("grad.w", dtype="float32"))
        streams[1].send(tensor("grad.w", dtype="float64"))
        for s in streams:
            (resp,) = s.responses()
            assert "mismatched dtype" in resp.error_message
        samples = scrape(http)
        assert job_value(samples, "hora_negotiation_messages_total", job) == 4
        assert job_value(samples, "hora_negotiated_tensors_total", job) == 2
        # The same numbers as the REST view: both read the one set of counters.
        detail = http.get(f"/api/v1/jobs/{job}").json()
        errors = job_value(samples, "hora_negotiation_errors_total", job)
        assert errors == detail["errors"] == 1  # one error response, sent to both ranks

        for i, w in enumerate(workers):
            client.leave(job, w)
            streams[i].close()
        samples = scrape(http)
        assert members(samples, job) == {"joining": 0, "active": 0, "left": 2, "lost": 0}
        assert jobs(samples) == {"gathering": 0, "running": 0, "finished": 1, "failed": 0}
    finally:
        for s in streams:
            s.cancel()


def test_jobs_are_labelled_apart_and_a_gathering_round_counts_as_joining(client, http):
    running = new_job_id()
    views = client.join_all(running, 1)
    stream = client.stream(running, views[0].members[0].worker_id, 1)
    gathering = new_job_id()
    try:
        stream.send(tensor("only"))
        assert [list(r.tensor_names) for r in stream.responses()] == [["only"]]
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.join, gathering, "early", 3, timeout=2)
            deadline = time.monotonic() + 5
            while http.get(f"/api/v1/jobs/{gathering}").status_code == 404:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            samples = scrape(http)
            assert job_value(samples, "hora_negotiated_tensors_total", running) == 1
            assert job_value(samples, "hora_negotiated_tensors_total", gathering) == 0
            assert job_value(samples, "hora_job_generation", running) == 1
            assert job_value(samples, "hora_job_generation", gathering) == 0
            assert members(samples, gathering) == {
                "joining": 1, "active": 0, "left": 0, "lost": 0
            }  # fmt: skip
            assert members(samples, running)["active"] == 1
            assert jobs(samples) == {"gathering": 1, "running": 1, "finished": 0, "failed": 0}
            with pytest.raises(grpc.RpcError):
                waiting.result(timeout=5)  # the world of 3 never gathers
    finally:
        stream.cancel()


def test_a_lost_member_and_failed_job_show_up(client, http):
    job = new_job_id()
    views = client.join_all(job, 2)
    streams = [client.stream(job, m.worker_id, 1) for m in views[0].members]
    try:
        for s in streams:
            s.send()  # both streams open before one breaks
        time.sleep(0.2)
        streams[0].cancel()
        assert streams[1].event().message == "stream closed"
        samples = scrape(http)
        assert members(samples, job) == {"joining": 0, "active": 1, "left": 0, "lost": 1}
        assert jobs(samples)["failed"] == 1
    finally:
        for s in streams:
            s.cancel()


@pytest.mark.unit
def test_collector_reads_state_at_each_scrape_in_process():
    from hora_coordinator import Coordinator, CoordinatorSettings
    from hora_coordinator import state as st
    from hora_coordinator.metrics import create_registry, render

    coordinator = Coordinator(CoordinatorSettings(token="t"))
    registry = create_registry(coordinator)
    job = coordinator.jobs["j"] = st.new_job("j", 0.0)

    def value(name: str) -> float:
        text = render(registry).decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    return sample.value
        raise AssertionError(f"{name} missing from:\n{text}")

    assert value("hora_negotiated_tensors_total") == 0
    job.negotiated_tensors = 41
    job.negotiated_tensors += 1  # no second copy to update: the next scrape sees it
    assert value("hora_negotiated_tensors_total") == 42


@pytest.mark.unit
def test_elastic_resets_are_counted():
    from coordinator_transitions import form, jreq

    from hora_coordinator import Coordinator, CoordinatorSettings
    from hora_coordinator import state as st
    from hora_coordinator.metrics import create_registry, render

    coordinator = Coordinator(CoordinatorSettings(token="t"))
    registry = create_registry(coordinator)
    job = coordinator.jobs["job"] = form(2, min_size=1, max_size=2)
    st.leave(job, "w1", "done", 1.0)
    st.leave(job, "w0", "reset", 1.0, rejoin=True)
    st.join(job, jreq("w0", 2, min_size=1), 1.5)
    samples = {
        (s.name, s.labels.get("job_id")): s.value
        for family in text_string_to_metric_families(render(registry).decode())
        for s in family.samples
    }
    assert samples[("hora_job_resets_total", "job")] == 1
    assert samples[("hora_job_generation", "job")] == 2
