"""Unit tests of the per-job runtime (issue 26): forgetting a job leaves nothing of it.

A real coordinator (no server) serves two jobs through its own calls: Joins,
streams, heartbeats, the store, requests, a departure. One job ends and is
forgotten by the periodic check; then every object reachable from the
coordinator is searched for its id.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta

import pytest
from coordinator_transitions import treq
from google.protobuf.message import Message

from hora_coordinator import Coordinator, CoordinatorSettings, state
from hora_coordinator.messages import JoinRequest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

GONE, KEPT = "job-that-goes-f3a9", "job-that-stays-7c21"


def _join(job_id: str, worker: str) -> JoinRequest:
    return JoinRequest(job_id=job_id, worker_id=worker, host="h", pid=7, expected_size=2,
                       rank_hint=-1, data_plane_address="127.0.0.1")


def _paths_to(root: object, needle: str, limit: int = 50) -> list[str]:
    """Where ``needle`` appears among the objects reachable from ``root``: dict keys and
    values, sequence items, attributes (``__dict__`` and slots), protobuf messages."""
    found: list[str] = []
    seen: set[int] = set()
    work: list[tuple[object, str]] = [(root, "coordinator")]
    while work and len(found) < limit:
        obj, path = work.pop()
        if isinstance(obj, str):
            if needle in obj:
                found.append(path)
            continue
        if obj is None or isinstance(obj, (int, float, bytes, type)) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if callable(obj) and not hasattr(obj, "__dict__"):
            continue
        if isinstance(obj, Message):
            if needle in str(obj):
                found.append(path)
            continue
        if isinstance(obj, dict):
            for key, value in obj.items():
                work.append((key, f"{path} key {key!r}"))
                work.append((value, f"{path}[{key!r}]"))
            continue
        if isinstance(obj, (list, tuple, set, frozenset)) or type(obj).__name__ == "deque":
            work.extend((item, f"{path}[{i}]") for i, item in enumerate(obj))  # type: ignore[arg-type]
            continue
        if isinstance(obj, asyncio.Queue):
            work.append((list(obj._queue), f"{path}.queue"))  # type: ignore[attr-defined]
        attributes = dict(getattr(obj, "__dict__", {}))
        for cls in type(obj).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if hasattr(obj, slot):
                    attributes[slot] = getattr(obj, slot)
        work.extend((value, f"{path}.{name}") for name, value in attributes.items())
    return found


async def _serve_two_jobs(coordinator: Coordinator) -> None:
    for job_id in (GONE, KEPT):
        views = await asyncio.wait_for(asyncio.gather(
            coordinator.join(_join(job_id, "w0")), coordinator.join(_join(job_id, "w1"))), 10)
        generation = views[0].generation
        for worker in ("w0", "w1"):
            coordinator.open_stream(job_id, worker, generation)
            coordinator.heartbeat(job_id, worker)
            coordinator.stream_heartbeat(job_id, worker, generation, 1)
        coordinator.store(job_id).set(f"{job_id}/key", job_id.encode())
        for worker in ("w0", "w1"):
            coordinator.requests(job_id, worker, generation, [treq("grad")])
        coordinator.check()  # leases sized, notices delivered
    # GONE ends: its members leave, their streams close.
    for worker in ("w0", "w1"):
        coordinator.leave(GONE, worker, "shutdown")
        coordinator.stream_closed(GONE, worker, 1)


def test_a_forgotten_job_leaves_nothing_of_it_in_the_coordinator():
    coordinator = Coordinator(CoordinatorSettings(token="t", job_retention=timedelta(0)))
    asyncio.run(_serve_two_jobs(coordinator))
    assert coordinator.jobs[GONE].phase is state.JobPhase.FINISHED
    # Before: the search finds the job everywhere it is held.
    held = _paths_to(coordinator, GONE)
    assert any("runtimes" in path for path in held)
    coordinator.check()  # marks it ended
    coordinator.check()  # retention 0: forgotten
    assert GONE not in coordinator.jobs
    assert _paths_to(coordinator, GONE) == []
    # The other job is untouched, and the search does see it.
    assert coordinator.jobs[KEPT].phase is state.JobPhase.RUNNING
    assert coordinator.store(KEPT).get_now(f"{KEPT}/key") == KEPT.encode()
    assert _paths_to(coordinator, KEPT)


def test_a_job_is_held_in_one_runtime_object():
    coordinator = Coordinator(CoordinatorSettings(token="t"))
    asyncio.run(_serve_two_jobs(coordinator))
    runtime = coordinator.runtimes[KEPT]
    assert runtime.job is coordinator.jobs[KEPT]
    assert runtime.store is coordinator.store(KEPT)
    assert set(runtime.outboxes) == {"w0", "w1"}
    assert set(runtime.open_streams) == {("w0", 1), ("w1", 1)}
    assert runtime.heartbeats == {"unary": 2, "stream": 2} and runtime.messages_queued > 0
    assert runtime.lease is not None
    # Nothing per job is held beside the runtimes but the departure notices (empty
    # after each check) and the journal.
    per_job = [f.name for f in dataclasses.fields(runtime)]
    assert {"store", "joins", "set_calls", "outboxes", "open_streams", "lease"} <= set(per_job)
    outside = [path for path in _paths_to(coordinator, KEPT)
               if not path.startswith(("coordinator.runtimes", "coordinator.jobs"))]
    assert outside == []
