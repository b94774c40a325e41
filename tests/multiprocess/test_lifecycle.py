"""init / shutdown: Horovod's lifecycle contracts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.workers import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

SCENARIOS = Path(__file__).with_name("scenarios.py")
SCENARIOS_LIVENESS = SCENARIOS.with_name("scenarios_liveness.py")


def test_shutdown_then_init_in_the_same_process(shared_coordinator):
    results = run_workers(shared_coordinator, 2, SCENARIOS, "shutdown_and_init_again")
    for rank, r in enumerate(results):
        first, second, new_rank, size = r.value
        torch.testing.assert_close(first, torch.full((2,), 2.0))
        torch.testing.assert_close(second, torch.full((2,), 4.0))
        assert (new_rank, size) == (rank, 2)


def test_calls_before_init_say_so(shared_coordinator):
    results = run_workers(shared_coordinator, 2, SCENARIOS, "use_before_init")
    for r in results:
        assert "hvd.init()" in r.value


@pytest.mark.parametrize("size", [2, 3])
def test_a_peer_that_shuts_down_right_after_a_collective_never_fails_it(shared_coordinator,
                                                                        size):
    # 9 generations in one launch: barrier, allreduce or cached allreduce, rank 0
    # late to it, the others shutting down (and at the end exiting) as soon as it
    # returns. A call that returned on one rank has completed on every rank.
    results = run_workers(shared_coordinator, size, SCENARIOS_LIVENESS, "finish_first", (9,),
                          timeout=100)
    for r in results:
        assert r.value == [], r.value
