"""Unit tests of the elastic planner's Horovod rules: the host assignment and
the start ranks it gives, a failed host's other workers, the cooldown
backoff, and the reset limit (fake clock, no processes)."""

from __future__ import annotations

import random
import signal
from datetime import timedelta

import pytest

from hora.runner.elastic import (
    Action,
    ElasticPlanner,
    ElasticPolicy,
    Finish,
    Say,
    StartWorker,
    StopWorker,
)
from hora.runner.elastic_actions import cooldown_after
from hora.runner.env import elastic_worker_environment
from hora.runner.hosts import HostSlots, SlotInfo
from hora.settings import Settings

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def planner(cooldown: tuple[float, float] | None = None, reset_limit: int | None = None,
            max_np: int | None = 4) -> tuple[ElasticPlanner, Clock]:
    clock = Clock()
    policy = ElasticPolicy(
        num_proc=2, min_np=2, max_np=max_np, elastic_timeout=timedelta(seconds=60),
        cooldown_range=(None if cooldown is None else
                        (timedelta(seconds=cooldown[0]), timedelta(seconds=cooldown[1]))),
        reset_limit=reset_limit)
    return ElasticPlanner(policy, clock=clock, rng=random.Random(1)), clock


def hosts(*specs: str) -> list[HostSlots]:
    return [HostSlots(h, int(n)) for h, n in (spec.split(":") for spec in specs)]


def started(p: ElasticPlanner, actions: list[Action]) -> dict[str, tuple[int, int]]:
    """Plays the supervisor; label -> (worker id, start rank)."""
    out = {}
    for action in actions:
        if isinstance(action, StartWorker):
            assert action.placement is not None
            p.worker_running(action.worker_id, 1000 + action.worker_id)
            out[action.label] = (action.worker_id, action.placement.rank)
    return out


def test_start_ranks_follow_horovods_assignment_as_hosts_come_and_go() -> None:
    p, _ = planner()
    p.hosts_discovered(hosts("localhost:2"))
    first = started(p, p.tick())
    assert {k: v[1] for k, v in first.items()} == {"localhost:0": 0, "localhost:1": 1}
    # A new host is appended: its workers start as ranks 2 and 3 of 4.
    p.hosts_discovered(hosts("127.0.0.1:2", "localhost:2"))
    actions = p.tick()
    assert [a.placement for a in actions if isinstance(a, StartWorker)] == [
        SlotInfo("127.0.0.1", 2, 4, 0, 2, 1, 2), SlotInfo("127.0.0.1", 3, 4, 1, 2, 1, 2)]
    started(p, actions)
    # The first host leaves: the other keeps its workers and now leads the order.
    actions = p.hosts_discovered(hosts("127.0.0.1:2"))
    assert [a for a in actions if isinstance(a, StopWorker)] == [
        StopWorker(first["localhost:0"][0]), StopWorker(first["localhost:1"][0])]
    assert [(s.hostname, s.rank) for s in p.assignment()] == [("127.0.0.1", 0), ("127.0.0.1", 1)]
    assert p.tick() == []


def test_a_failure_kills_the_hosts_other_workers_and_its_host_returns_last() -> None:
    p, clock = planner(cooldown=(1, 2))
    p.hosts_discovered(hosts("localhost:2", "127.0.0.1:2"))
    ids = started(p, p.tick())
    assert len(ids) == 4  # -np 2, but every slot up to --max-num-proc 4
    actions = p.worker_exited(ids["localhost:0"][0], 1)
    message = ("worker on localhost (pid 1000) exited with code 1; blacklisting localhost "
               "for 2.0 s and killing its other worker")
    assert actions[0] == Say(message)
    assert actions[2:] == [StopWorker(ids["localhost:1"][0], signal.SIGKILL)]
    # Killed on purpose: not a second failure.
    assert p.worker_exited(ids["localhost:1"][0], -9) == []
    assert p.tick() == [] and p.active_workers() == 2
    clock.now += 2.0
    actions = p.tick()
    assert "host localhost is back after its 2.0 s cooldown" in actions[0].message
    # Back at the end of the order: ranks 2 and 3, the world grows to 4 again.
    back = started(p, actions)
    assert back == {"localhost:0": (4, 2), "localhost:1": (5, 3)}


def test_cooldown_backoff_is_horovods() -> None:
    assert [cooldown_after(n, 1.0, 3600.0, 0.0) for n in (1, 2, 3, 4)] == [2, 4, 8, 16]
    assert cooldown_after(1, 10.0, 3600.0, 0.5) == 25.0
    assert cooldown_after(3, 1.0, 5.0, 0.9) == 5.0  # held at MAX
    assert cooldown_after(1, 4.0, 4.0, 0.0) == 4.0


def test_the_reset_limit_counts_generations_after_the_first() -> None:
    p, _ = planner(reset_limit=1)
    p.hosts_discovered(hosts("a:2"))
    started(p, p.tick())
    assert p.generation_formed(1) == [] and p.generation_formed(2) == []
    assert p.generation_formed(3) == [
        Say("reset limit 1 exceeded: the worker set changed 2 times (--reset-limit 1); "
            "stopping the job"),
        Finish(1)]
    assert p.done
    unlimited, _ = planner()
    unlimited.hosts_discovered(hosts("a:2"))
    started(unlimited, unlimited.tick())
    assert unlimited.generation_formed(50) == [] and unlimited.resets == 49


def test_an_elastic_worker_gets_horovods_placement_of_its_start_slot() -> None:
    env = elastic_worker_environment(
        {"PATH": "/bin", "HOROVOD_RANK": "7"}, "127.0.0.1", size=2,
        coordinator="127.0.0.1:5000", job_id="j", token="t",
        worker_settings={"min_size": 2, "max_size": 4},
        placement=SlotInfo("127.0.0.1", 3, 4, 1, 2, 1, 2))
    assert {k: v for k, v in env.items() if k.startswith("HOROVOD_")} == {
        "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2",
        "HOROVOD_HOSTNAME": "127.0.0.1"}
    # The rank is the worker's hint to the coordinator; the size what the first
    # generation waits for.
    settings = Settings.from_env(env)
    assert (settings.rank, settings.size, settings.max_size) == (3, 4, 4)
