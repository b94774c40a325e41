"""Worker functions of test_liveness.py: heartbeats seen from real workers."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import torch

import hora.torch as hvd


def _heartbeats(http_url: str) -> dict[str, float]:
    """This job's heartbeats by transport, from the coordinator's /metrics."""
    job = f'job_id="{os.environ["HORA_JOB_ID"]}"'
    counts = {"unary": 0.0, "stream": 0.0}
    with urllib.request.urlopen(f"{http_url}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("hora_heartbeats_total{") and job in line:
                transport = line.split('transport="')[1].split('"')[0]
                counts[transport] = float(line.rsplit(" ", 1)[1])
    return counts


def _last_heartbeats(http_url: str) -> list[float]:
    """When each member last renewed its lease, from the coordinator's REST API."""
    url = f"{http_url}/api/v1/jobs/{os.environ['HORA_JOB_ID']}"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return [m["last_heartbeat"] for m in json.load(reply)["members"]]


def heartbeats_while_idle(http_url: str, seconds: float):
    """The job's heartbeats (by transport) and members' last renewals, before and
    after ``seconds`` of idling with the engine up."""
    hvd.allreduce(torch.ones(2), name="warm", op=hvd.Sum)
    before = _heartbeats(http_url), _last_heartbeats(http_url)
    time.sleep(seconds)
    after = _heartbeats(http_url), _last_heartbeats(http_url)
    # Keeps every rank in the job until each has read the counters; cached (the
    # same tensor again), so agreed peer to peer: it renews no lease meanwhile.
    hvd.allreduce(torch.ones(2), name="warm", op=hvd.Sum)
    return before, after


def train_until_file(stop_file: str, ready_dir: str):
    """Cached allreduces until ``stop_file`` exists (every rank stops at the same step)."""
    x = torch.ones(4)
    Path(ready_dir, f"ready.{hvd.rank()}").touch()
    steps = 0
    while True:
        flag = torch.tensor([1.0 if os.path.exists(stop_file) else 0.0])
        stop = hvd.allreduce(flag, name="stop", op=hvd.Max)
        y = hvd.allreduce(x, name="grad", op=hvd.Sum)
        assert y[0].item() == hvd.size(), y
        steps += 1
        if stop.item() > 0:
            return steps, hvd.size()
        time.sleep(0.02)


def stall_different_ops(wait_s: float):
    """Rank 0 allreduces 'a' while rank 1 allgathers 'b'; after ``wait_s``
    seconds each submits the other's too, and both complete."""
    x = torch.ones(2)
    if hvd.rank() == 0:
        first = hvd.allreduce_async(x, name="a", op=hvd.Sum)
        time.sleep(wait_s)
        second = hvd.allgather_async(x, name="b")
        return [hvd.synchronize(first), hvd.synchronize(second)]
    first = hvd.allgather_async(x, name="b")
    time.sleep(wait_s)
    second = hvd.allreduce_async(x, name="a", op=hvd.Sum)
    return [hvd.synchronize(second), hvd.synchronize(first)]


def stall_cached_different_tensors(wait_s: float):
    """Both ranks allreduce 'x' and 'y' once (cached from then on); then rank 0
    allreduces 'x' while rank 1 allreduces 'y', and after ``wait_s`` seconds
    each submits the other's too."""
    x = torch.ones(2)
    for name in ("x", "y"):
        hvd.allreduce(x, name=name, op=hvd.Sum)
    mine, theirs = ("x", "y") if hvd.rank() == 0 else ("y", "x")
    first = hvd.allreduce_async(x, name=mine, op=hvd.Sum)
    time.sleep(wait_s)
    second = hvd.allreduce_async(x, name=theirs, op=hvd.Sum)
    return [hvd.synchronize(first), hvd.synchronize(second)]


def finish_first(iterations: int):
    """Generation after generation in one process: a last collective (a barrier,
    a negotiated allreduce, a cached one whose bytes ride the agreement round),
    which rank 0 comes to late, then every rank but rank 0 shuts down at once,
    while rank 0 may still be finishing the call. Returns this rank's failures."""
    failures = []
    for i in range(iterations):
        if i:
            hvd.init()
        kind = ("barrier", "allreduce", "cached")[i % 3]
        try:
            for _ in range(2):
                hvd.allreduce(torch.ones(4), name="warm", op=hvd.Sum)
            if hvd.rank() == 0:
                time.sleep(0.02 * (i % 4))
            if kind == "barrier":
                hvd.barrier()
            elif kind == "allreduce":
                hvd.allreduce(torch.ones(3), name=f"last.{i}", op=hvd.Sum)
            else:
                hvd.allreduce(torch.ones(4), name="warm", op=hvd.Sum)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            failures.append(f"iteration {i} ({kind}): {type(exc).__name__}: {exc}")
        if i < iterations - 1:
            hvd.shutdown()
    return failures
