"""The response cache: steady-state steps skip the coordinator; changes renegotiate."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from tests.support.workers import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

SCENARIOS = Path(__file__).with_name("scenarios_cache.py")


@pytest.mark.parametrize("size", [2, 3])
def test_steady_state_sends_no_negotiation_messages(shared_coordinator, size):
    job_id = f"cache-{uuid.uuid4().hex[:8]}"
    results = run_workers(shared_coordinator, size, SCENARIOS, "steady_state_messages",
                          (shared_coordinator.http_url, job_id, 10), job_id=job_id)
    before, after, idle = results[0].value
    barrier_cost = idle - after
    assert barrier_cost == size  # one message per rank for the last barrier
    assert after - before - barrier_cost == 0, (before, after, idle)


def test_steady_state_with_the_cache_disabled_asks_the_coordinator(shared_coordinator):
    job_id = f"nocache-{uuid.uuid4().hex[:8]}"
    results = run_workers(shared_coordinator, 2, SCENARIOS, "steady_state_messages",
                          (shared_coordinator.http_url, job_id, 10), job_id=job_id,
                          env={"HORA_CACHE_CAPACITY": "0"})
    before, after, idle = results[0].value
    assert after - before - (idle - after) >= 10 * 2  # at least one message per rank a step


def test_changed_shape_renegotiates_and_a_one_sided_change_is_a_mismatch(shared_coordinator):
    results = run_workers(shared_coordinator, 2, SCENARIOS, "cache_invalidation")
    for r in results:
        out = r.value
        for i in range(3):
            torch.testing.assert_close(out[f"same.{i}"], torch.full((4,), 2.0))
        torch.testing.assert_close(out["grown"], torch.full((6,), 2.0))
        torch.testing.assert_close(out["grown.again"], torch.full((6,), 2.0))
        kind, message = out["mismatch"]
        assert kind == "TensorMismatchError" and "'x'" in message and "dtype" in message
        torch.testing.assert_close(out["after"], torch.full((2,), 2.0))
