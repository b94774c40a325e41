"""Unit tests of the coordinator's periodic check loop (no servers)."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest

from hora_coordinator import Coordinator, CoordinatorSettings, state

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_a_slow_check_is_not_taken_for_a_stalled_loop():
    # Each check blocks the loop for three periods; the sleeps between them
    # are on time, so nothing is late and no stall is forgiven.
    interval = 0.1
    coordinator = Coordinator(
        CoordinatorSettings(token="t", stall_check_interval=timedelta(seconds=interval))
    )
    checks: list[float] = []
    forgiven: list[float] = []

    def slow_check() -> None:
        checks.append(time.monotonic())
        time.sleep(3 * interval)

    coordinator.check = slow_check  # type: ignore[method-assign]
    coordinator.forgive_stall = forgiven.append  # type: ignore[method-assign]

    async def run() -> None:
        task = asyncio.create_task(coordinator.run_checks())
        while len(checks) < 3:
            await asyncio.sleep(interval / 4)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert forgiven == []


def test_a_backlog_of_calls_the_coordinator_has_not_taken_extends_every_lease():
    # The coordinator's own health check to itself has waited 3 s: so may a
    # heartbeat. A member silent for 2.5 s on a 2 s lease is not lost meanwhile;
    # once the check is answered quickly again, the lease is judged as it is.
    from coordinator_transitions import form

    now = [100.0]
    coordinator = Coordinator(CoordinatorSettings(token="t", lease=timedelta(seconds=2)),
                              clock=lambda: now[0])
    job = form(2, now=now[0])
    coordinator.jobs[job.job_id] = job
    answer = asyncio.Event()

    async def probe() -> None:
        await answer.wait()

    async def run() -> None:
        task = asyncio.create_task(coordinator.measure_backlog(probe))
        await asyncio.sleep(0.6)  # the self-check is still unanswered
        assert coordinator.backlog_s() >= 0.5
        now[0] += 2.4  # silent longer than the lease, not than lease + backlog
        coordinator.check()
        assert [m.state for m in job.members] == [state.MemberState.ACTIVE] * 2
        answer.set()  # answered: the next checks time a quick round trip
        while coordinator.backlog_s() > 0.1:
            await asyncio.sleep(0.01)
        coordinator.check()
        assert job.phase is state.JobPhase.FAILED
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
