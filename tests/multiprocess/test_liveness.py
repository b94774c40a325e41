"""Liveness with real workers: heartbeats ride the negotiation stream at the interval
the coordinator asks, and the coordinator's own pause costs no worker its place."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.support.workers import collect, describe, run_workers, start_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

SCENARIOS = Path(__file__).with_name("scenarios_liveness.py")


def test_workers_renew_their_lease_on_the_stream_not_with_calls(coordinator_factory):
    coordinator = coordinator_factory()  # default lease and interval (2 s, 0.5 s)
    results = run_workers(coordinator, 2, SCENARIOS, "heartbeats_while_idle",
                          (coordinator.http_url, 3.0))
    (before, _), (after, _) = results[0].value
    assert after["unary"] == before["unary"], (before, after)  # one call per worker at init
    assert after["stream"] > before["stream"], (before, after)


def test_workers_heartbeat_only_as_often_as_the_coordinator_asks(coordinator_factory):
    # One heartbeat every 30 s: none comes in 3 s of idling (at a fixed 1 s
    # cadence there would be about 6).
    coordinator = coordinator_factory("--lease-s", "120", "--heartbeat-interval-s", "30")
    results = run_workers(coordinator, 2, SCENARIOS, "heartbeats_while_idle",
                          (coordinator.http_url, 3.0))
    (beats_before, renewed_before), (beats_after, renewed_after) = results[0].value
    assert renewed_after == renewed_before, (renewed_before, renewed_after)
    assert beats_after == beats_before, (beats_before, beats_after)


def test_a_stopped_coordinator_costs_real_workers_nothing(coordinator_factory, tmp_path):
    # The coordinator stops for twice the lease while the workers train (cached
    # rounds go on peer to peer) and heartbeat into its unread sockets. Once it
    # resumes it must forgive its own pause: nobody is lost, training ends normally.
    coordinator = coordinator_factory("--lease-s", "2")
    stop_file = tmp_path / "stop"
    job_id = "liveness-pause"
    procs = start_workers(coordinator, 2, SCENARIOS, "train_until_file",
                          (str(stop_file), str(tmp_path)), job_id=job_id)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready.{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline, "the workers never started training"
        assert all(p.poll() is None for p, _ in procs), describe(collect(procs, 5))
        time.sleep(0.05)
    time.sleep(1.0)  # a couple of heartbeats on the stream first
    os.kill(coordinator.pid, signal.SIGSTOP)
    try:
        time.sleep(4.0)
    finally:
        os.kill(coordinator.pid, signal.SIGCONT)
    time.sleep(3.0)  # more than a lease after it resumed: a loss would have happened
    stop_file.touch()
    results = collect(procs, timeout=60)
    assert all(r.ok for r in results), describe(results)
    assert all(r.value[1] == 2 for r in results), describe(results)
    events = httpx.get(f"{coordinator.http_url}/api/v1/jobs/{job_id}/events", timeout=5).json()
    assert [e for e in events if e["kind"] == "lost"] == [], events
