"""The dashboard's figures come from real training (issue 12).

A 3-rank job under ``horarun --coordinator`` trains against a standalone
coordinator; rank 2 sleeps in every step. Its heartbeats carry each rank's
telemetry; the REST API must show steps counted by ``DistributedOptimizer``,
steps and samples per second, the response cache doing the work with no
coordinator message per step in steady state, and rank 2 as the straggler.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from tests.support.coordinator import CoordinatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

HORARUN = [sys.executable, "-m", "hora.runner.launch"]

WORKER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    import hora.torch as hvd

    stop, slow_rank, nap = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    hvd.init()
    hvd.set_batch_size(32)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.randn(32, 8)
    y = x.sum(dim=1, keepdim=True)
    deadline = time.monotonic() + 120
    while True:
        if hvd.rank() == slow_rank:
            time.sleep(nap)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        # Every rank stops after the same step: a rank that saw the stop file
        # alone would leave the others waiting in their next step's allreduce.
        done = stop.exists() or time.monotonic() > deadline
        if hvd.allreduce(torch.tensor([float(done)]), name="stop", op=hvd.Max).item() > 0:
            break
        time.sleep(0.01)
    hvd.shutdown()
""")


def _telemetry(coord: CoordinatorProcess, job: str) -> dict:
    answer = httpx.get(f"{coord.http_url}/api/v1/jobs/{job}/telemetry", timeout=5)
    answer.raise_for_status()
    return answer.json()


def _wait(coord: CoordinatorProcess, job: str, proc: subprocess.Popen, what: str,
          ok, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    seen: dict = {}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"horarun exited ({proc.returncode}) early")
        try:
            seen = _telemetry(coord, job)
        except httpx.HTTPStatusError:
            seen = {}
        if seen and ok(seen):
            return seen
        time.sleep(0.25)
    raise AssertionError(f"{what} never held; last telemetry: {seen}")


def test_heartbeats_carry_steps_rates_cache_use_and_the_straggler(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    stop = tmp_path / "stop"
    job = "telemetry-job"
    with CoordinatorProcess() as coord:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HORA_TOKEN": coord.token}
        proc = subprocess.Popen(
            [*HORARUN, "-np", "3", "--coordinator", coord.grpc_address, "--job-id", job,
             sys.executable, str(script), str(stop), "2", "0.05"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            seen = _wait(coord, job, proc, "every rank reported 30 steps and 20 rounds",
                         lambda t: len(t["ranks"]) == 3 and all(
                             r["reported"] and r["steps"] >= 30 and r["rounds"] >= 20
                             for r in t["ranks"]))
            ranks = {r["rank"]: r for r in seen["ranks"]}
            assert all(r["state"] == "active" and r["pid"] > 0 and r["host"]
                       for r in ranks.values()), ranks
            for r in ranks.values():
                # About 15 steps/s at most with the 50 ms nap; more than 1 for sure.
                assert 1 < r["steps_per_s"] < 30, r
                assert r["batch_size"] == 32 and r["samples_per_s"] > 32, r
                assert r["last_step_s"] > 0.04, r
            # Rank 2 naps: the others wait for it at every round.
            assert seen["stragglers"]["slowest_rank"] == 2, seen["stragglers"]
            assert seen["stragglers"]["is_straggler"], seen["stragglers"]
            assert ranks[2]["straggler"] and not ranks[0]["straggler"], ranks
            # A step holds about three rounds (gradients, then the stop flag), and only
            # the first waits for the nap:
            # the p95 shows the nap, the median need not.
            assert ranks[2]["lateness_p95_ms"] > 20, ranks[2]
            assert ranks[0]["lateness_p95_ms"] < ranks[2]["lateness_p95_ms"] / 4, ranks
            assert ranks[2]["last_share"] > max(ranks[0]["last_share"], ranks[1]["last_share"])
            # The cache carries the steps: after the first, nothing reaches the coordinator.
            negotiation = seen["negotiation"]
            assert negotiation["cache_hit_ratio"] > 0.9, negotiation
            seen = _wait(coord, job, proc, "a sample with 0 messages per step",
                         lambda t: t["series"] and t["series"][-1]["messages_per_step"] == 0)
            last = seen["series"][-1]
            assert last["size"] == 3 and last["generation"] == 1, last
            assert last["steps_per_s"] > 1 and last["samples_per_s"] > 3 * 32, last
            assert [m["generation"] for m in seen["generations"]] == [1], seen["generations"]
            summary = next(j for j in httpx.get(f"{coord.http_url}/api/v1/jobs").json()
                           if j["job_id"] == job)
            assert summary["steps_per_s"] > 1 and summary["last_event"]["kind"], summary
            # The same figures on /metrics, per rank.
            metrics = httpx.get(f"{coord.http_url}/metrics", timeout=5).text
            assert 'hora_rank_steps_total{host="' in metrics or "hora_rank_steps_total{" \
                in metrics, metrics[-2000:]
            assert (f'hora_rank_last_arrival_ratio{{host="{ranks[2]["host"]}",job_id="{job}",'
                    f'rank="2"}}') in metrics, metrics[-2000:]
            assert 'hora_rank_straggler_lag_seconds{' in metrics
            assert "hora_rank_steps_per_second{" in metrics
            assert f'hora_job_messages_per_step{{job_id="{job}"}} 0.0' in metrics
        finally:
            stop.touch()
            try:
                out, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
        assert proc.returncode == 0, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
