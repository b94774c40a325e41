"""Unit tests of the coordinator's periodic check loop (no servers)."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest

from hora_coordinator import Coordinator, CoordinatorSettings

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
