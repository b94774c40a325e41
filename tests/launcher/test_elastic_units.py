"""Unit tests of elastic mode: the planner's decisions under a fake clock, and
in-process runs of the executor (flags, discovery, environment: test_elastic_flags.py)."""

from __future__ import annotations

import functools
import io
import random
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from launcher_helpers import pid_gone

from hora.runner.discovery import HostPoller, run_discovery_script
from hora.runner.elastic import (
    Action,
    ElasticPlanner,
    ElasticPolicy,
    Finish,
    ReportEvent,
    Say,
    StartWorker,
    StopWorker,
)
from hora.runner.elastic_driver import ElasticDriver
from hora.runner.hosts import HostSlots, SlotInfo
from hora.runner.output import WorkerOutput

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


# -- the planner -------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _planner(num_proc: int = 2, min_np: int = 2, max_np: int | None = None,
             timeout: float = 10.0, cooldown: tuple[float, float] | None = None,
             seed: int = 7) -> tuple[ElasticPlanner, FakeClock]:
    clock = FakeClock()
    policy = ElasticPolicy(
        num_proc=num_proc, min_np=min_np, max_np=max_np,
        elastic_timeout=timedelta(seconds=timeout),
        cooldown_range=(None if cooldown is None else
                        (timedelta(seconds=cooldown[0]), timedelta(seconds=cooldown[1]))))
    return ElasticPlanner(policy, clock=clock, rng=random.Random(seed)), clock


def _hosts(spec: str) -> list[HostSlots]:
    return [HostSlots(name, int(slots)) for name, slots in
            (item.split(":") for item in spec.split(",") if item)]


def _starts(actions: list[Action]) -> list[str]:
    return [a.label for a in actions if isinstance(a, StartWorker)]


def _said(actions: list[Action]) -> list[str]:
    return [a.message for a in actions if isinstance(a, Say)]


def _run(planner: ElasticPlanner, actions: list[Action]) -> dict[str, int]:
    """Plays the supervisor: every started worker gets a pid; label -> worker id."""
    ids = {}
    for action in actions:
        if isinstance(action, StartWorker):
            planner.worker_running(action.worker_id, 100 + action.worker_id)
            ids[action.label] = action.worker_id
    return ids


def test_initial_placement_fills_hosts_in_discovery_order() -> None:
    planner, _ = _planner(num_proc=3, min_np=2, max_np=4)
    assert planner.tick() == []  # nothing discovered yet
    assert planner.hosts_discovered(_hosts("b:2,a:1,c:5")) == []
    actions = planner.tick()
    # As horovodrun: once -np slots are there, every usable slot up to max_np.
    assert actions == [StartWorker(0, "b", 0), StartWorker(1, "b", 1), StartWorker(2, "a", 0),
                       StartWorker(3, "c", 0)]
    assert not any(a.announce for a in actions if isinstance(a, StartWorker))
    # Each starts with its slot's place in that assignment (HOROVOD_RANK and friends).
    assert [a.placement for a in actions if isinstance(a, StartWorker)] == [
        SlotInfo("b", 0, 4, 0, 2, 0, 3), SlotInfo("b", 1, 4, 1, 2, 0, 1),
        SlotInfo("a", 2, 4, 0, 1, 1, 3), SlotInfo("c", 3, 4, 0, 1, 2, 3)]
    _run(planner, actions)
    assert planner.tick() == []
    assert planner.active_workers() == 4


def test_initial_start_waits_for_np_slots() -> None:
    planner, clock = _planner(num_proc=3, min_np=2)
    planner.hosts_discovered(_hosts("a:1"))
    assert planner.tick() == []
    clock.advance(5)
    planner.hosts_discovered(_hosts("a:1,b:1"))
    # Enough for min_np though not for -np: horovodrun waits for -np.
    assert planner.tick() == []
    planner.hosts_discovered(_hosts("a:1,b:1,c:1"))
    assert _starts(planner.tick()) == ["a:0", "b:0", "c:0"]


def test_initial_start_times_out() -> None:
    planner, clock = _planner(num_proc=2, min_np=2, timeout=10)
    planner.hosts_discovered(_hosts("a:1"))
    clock.advance(9.9)
    assert planner.tick() == []
    clock.advance(0.1)
    assert planner.tick() == [
        Say("elastic job needs at least 2 workers; discovery offered 1 usable slot(s) "
            "within 10 s"),
        Finish(1)]
    assert planner.done and planner.tick() == []


def test_failure_blacklists_the_host_and_replaces_the_worker_elsewhere() -> None:
    planner, _ = _planner(num_proc=2, min_np=2, max_np=2)
    planner.hosts_discovered(_hosts("a:1,b:1,c:1"))
    ids = _run(planner, planner.tick())
    assert list(ids) == ["a:0", "b:0"]
    actions = planner.worker_exited(ids["b:0"], 3)
    message = "worker on b (pid 101) exited with code 3; blacklisting b"
    assert actions == [Say(message), ReportEvent("blacklist", "b", message)]
    assert planner.blacklisted("b")
    actions = planner.tick()
    assert actions == [StartWorker(2, "c", 0, announce=True)]
    # A death by signal is a failure too.
    _run(planner, actions)
    actions = planner.worker_exited(2, -9)
    assert _said(actions) == ["worker on c (pid 102) was killed by SIGKILL; blacklisting c"]
    # No usable slot left: nothing starts, and the job is below min_np.
    assert planner.tick() == []


def test_blacklisted_host_never_returns_without_cooldown() -> None:
    planner, clock = _planner(num_proc=1, min_np=1, timeout=1000)
    planner.hosts_discovered(_hosts("a:1"))
    ids = _run(planner, planner.tick())
    planner.worker_exited(ids["a:0"], 1)
    clock.advance(999)
    assert planner.tick() == []
    assert planner.blacklisted("a")


def test_cooldown_is_drawn_in_range_doubles_and_ends() -> None:
    planner, clock = _planner(num_proc=1, min_np=1, timeout=1000, cooldown=(10, 100), seed=3)
    expected = random.Random(3)
    # Horovod's backoff: MIN * 2**failures + U(0, 1) * MIN, within [MIN, MAX].
    first = 10 * 2 + expected.random() * 10
    second = 10 * 4 + expected.random() * 10
    assert 20 <= first < 30 and 40 <= second < 50
    planner.hosts_discovered(_hosts("a:1"))
    ids = _run(planner, planner.tick())
    actions = planner.worker_exited(ids["a:0"], 1)
    assert _said(actions) == [f"worker on a (pid 100) exited with code 1; blacklisting a "
                              f"for {first:.1f} s"]
    clock.advance(first - 0.01)
    assert planner.tick() == []
    clock.advance(0.01)
    actions = planner.tick()
    message = f"host a is back after its {first:.1f} s cooldown"
    assert actions[:2] == [Say(message), ReportEvent("cooldown_over", "a", message)]
    # The host takes the replacement at once.
    assert actions[2:] == [StartWorker(1, "a", 0, announce=True)]
    _run(planner, actions)
    # A second failure: twice as long.
    actions = planner.worker_exited(1, 1)
    assert _said(actions)[0].endswith(f"blacklisting a for {second:.1f} s")
    clock.advance(second)
    assert _starts(planner.tick()) == ["a:0"]


def test_cooldown_never_exceeds_max() -> None:
    planner, clock = _planner(num_proc=1, min_np=1, timeout=1000, cooldown=(4, 5))
    planner.hosts_discovered(_hosts("a:1"))
    for worker_id in range(4):
        _run(planner, planner.tick())
        actions = planner.worker_exited(worker_id, 1)
        cooldown = float(_said(actions)[0].rsplit(" for ", 1)[1].split()[0])
        assert 4 <= cooldown <= 5
        clock.advance(5)


def test_below_min_np_for_the_elastic_timeout_fails() -> None:
    planner, clock = _planner(num_proc=2, min_np=2, timeout=10)
    planner.hosts_discovered(_hosts("a:1,b:1"))
    ids = _run(planner, planner.tick())
    planner.worker_exited(ids["b:0"], 1)
    assert planner.tick() == []  # the clock starts
    clock.advance(9)
    assert planner.tick() == []
    clock.advance(1)
    assert planner.tick() == [
        Say("elastic job needs at least 2 workers; only 1 running/available for 10 s"),
        Finish(1)]


def test_recovering_min_np_resets_the_timeout() -> None:
    planner, clock = _planner(num_proc=2, min_np=2, timeout=10)
    planner.hosts_discovered(_hosts("a:1,b:1"))
    ids = _run(planner, planner.tick())
    planner.worker_exited(ids["b:0"], 1)
    planner.tick()
    clock.advance(8)
    planner.hosts_discovered(_hosts("a:1,b:1,c:1"))
    assert _starts(planner.tick()) == ["c:0"]
    clock.advance(100)
    assert planner.tick() == []


def test_host_removal_stops_its_workers_without_blacklisting() -> None:
    planner, _ = _planner(num_proc=3, min_np=1)
    planner.hosts_discovered(_hosts("a:2,b:1"))
    ids = _run(planner, planner.tick())
    actions = planner.hosts_discovered(_hosts("b:1"))
    message = "host a is no longer offered by host discovery; stopping 2 workers there"
    assert actions == [Say(message), ReportEvent("host_removed", "a", message),
                       StopWorker(ids["a:0"]), StopWorker(ids["a:1"])]
    assert planner.active_workers() == 1
    # Their deaths (SIGTERM) are ours, not failures.
    assert planner.worker_exited(ids["a:0"], -15) == []
    assert planner.worker_exited(ids["a:1"], 1) == []
    assert not planner.blacklisted("a")
    # Nowhere to put replacements until a comes back; then they start there.
    assert planner.tick() == []
    planner.hosts_discovered(_hosts("b:1,a:2"))
    assert _starts(planner.tick()) == ["a:0", "a:1"]


def test_fewer_slots_on_a_host_stop_the_workers_beyond_them() -> None:
    planner, _ = _planner(num_proc=3, min_np=1)
    planner.hosts_discovered(_hosts("a:3"))
    ids = _run(planner, planner.tick())
    actions = planner.hosts_discovered(_hosts("a:1"))
    assert _said(actions) == ["host a now offers only 1 slot; stopping 2 workers there"]
    assert [a for a in actions if isinstance(a, StopWorker)] == [
        StopWorker(ids["a:1"]), StopWorker(ids["a:2"])]


def test_new_hosts_get_workers_up_to_max_np() -> None:
    planner, _ = _planner(num_proc=2, min_np=1, max_np=4)
    planner.hosts_discovered(_hosts("a:2"))
    _run(planner, planner.tick())
    planner.hosts_discovered(_hosts("a:2,b:1"))
    actions = planner.tick()
    assert actions == [StartWorker(2, "b", 0, announce=True)]
    _run(planner, actions)
    planner.hosts_discovered(_hosts("a:2,b:1,c:3"))
    assert _starts(planner.tick()) == ["c:0"]  # the fourth worker; max_np reached
    assert planner.tick() == []
    assert len(planner.assignment()) == 4


def test_stopping_workers_count_against_max_np() -> None:
    planner, _ = _planner(num_proc=2, min_np=1, max_np=2)
    planner.hosts_discovered(_hosts("a:1,b:1"))
    ids = _run(planner, planner.tick())
    planner.hosts_discovered(_hosts("b:1,c:1"))  # a's worker is being stopped
    assert planner.tick() == []
    planner.worker_exited(ids["a:0"], -15)
    assert _starts(planner.tick()) == ["c:0"]


def test_no_new_workers_after_the_first_success() -> None:
    planner, clock = _planner(num_proc=2, min_np=2, max_np=4, timeout=10)
    planner.hosts_discovered(_hosts("a:1,b:1"))
    ids = _run(planner, planner.tick())
    actions = planner.worker_exited(ids["a:0"], 0)
    assert _said(actions) == ["worker on a (pid 100) finished training; starting no more "
                              "workers and waiting up to 10 s for the other 1 worker"]
    planner.hosts_discovered(_hosts("a:1,b:1,c:2"))
    clock.advance(5)
    assert planner.tick() == []  # neither new hosts nor a free slot, nor min_np matter now
    assert planner.worker_exited(ids["b:0"], 0) == []
    assert planner.tick() == [Finish(0)]


def test_failure_after_success_decides_the_exit_code() -> None:
    planner, _ = _planner(num_proc=3, min_np=1)
    planner.hosts_discovered(_hosts("a:3"))
    ids = _run(planner, planner.tick())
    planner.worker_exited(ids["a:0"], 0)
    actions = planner.worker_exited(ids["a:1"], 4)
    assert _said(actions) == ["worker on a (pid 101) exited with code 4 after training "
                              "finished"]
    assert not planner.blacklisted("a")
    planner.worker_exited(ids["a:2"], 5)
    assert planner.tick() == [Finish(4)]


def test_stragglers_after_success_are_stopped_at_the_deadline() -> None:
    planner, clock = _planner(num_proc=2, min_np=1, timeout=10)
    planner.hosts_discovered(_hosts("a:2"))
    ids = _run(planner, planner.tick())
    planner.worker_exited(ids["a:0"], 0)
    clock.advance(10)
    assert planner.tick() == [
        Say("1 worker still running 10 s after training finished; stopping them"), Finish(1)]


def test_a_command_that_cannot_start_fails_the_job() -> None:
    planner, _ = _planner(num_proc=2, min_np=1)
    planner.hosts_discovered(_hosts("a:2"))
    first, _second = planner.tick()
    assert isinstance(first, StartWorker)
    assert planner.worker_start_failed(first.worker_id, 127, "No such file") == [
        Say("cannot start a worker on a: No such file"), Finish(127)]
    assert planner.done


def test_shutdown_stops_all_decisions() -> None:
    planner, _ = _planner(num_proc=1, min_np=1)
    planner.hosts_discovered(_hosts("a:1"))
    ids = _run(planner, planner.tick())
    planner.shutdown()
    assert planner.worker_exited(ids["a:0"], 1) == []
    assert planner.hosts_discovered([]) == []
    assert planner.tick() == []


# -- the executor, in process ----------------------------------------------------------


@pytest.mark.timeout(20)
def test_supervisor_kills_a_removed_hosts_worker_that_ignores_sigterm(tmp_path: Path) -> None:
    # In-process with a short grace period and discovery interval, so the
    # SIGKILL escalation is tested without waiting the real 5 s.
    hosts = [HostSlots("127.0.0.2", 1), HostSlots("127.0.0.3", 1)]
    ready = tmp_path / "ready"
    script = (
        "import os, pathlib, signal, sys, time\n"
        "host = os.environ['HOST']\n"
        f"ready = pathlib.Path({str(ready)!r})\n"
        "if host == '127.0.0.3':\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "    print('stubborn', flush=True); ready.touch(); time.sleep(30)\n"
        # The other one finishes once the stubborn one is gone.
        "while not ready.exists(): time.sleep(0.01)\n"
        "time.sleep(1.5)\n")
    planner = ElasticPlanner(ElasticPolicy(num_proc=2, min_np=1))

    def find() -> list[HostSlots]:
        if ready.exists():
            return hosts[:1]
        return list(hosts)

    out, err = io.StringIO(), io.StringIO()
    output = WorkerOutput(stdout=out, stderr=err)
    supervisor = ElasticDriver(
        planner, HostPoller(find, interval=0.05, say=output.say),
        lambda start: {"HOST": start.host}, [sys.executable, "-c", script],
        output=output, grace_period=0.5)
    assert supervisor.run() == 0
    assert "[127.0.0.3:0]<stdout>:stubborn\n" in out.getvalue()
    messages = err.getvalue()
    assert ("horarun: host 127.0.0.3 is no longer offered by host discovery; stopping "
            "1 worker there\n") in messages
    assert "horarun: 1 worker still running after 0.5 s; killing 127.0.0.3:0 (pid" \
        in messages
    assert "blacklisting" not in messages


def test_a_failure_after_success_outside_the_final_world_does_not_count() -> None:
    planner, _ = _planner(num_proc=3, min_np=1)
    planner.hosts_discovered(_hosts("a:3"))
    ids = _run(planner, planner.tick())
    assert not planner.training_finished
    planner.worker_exited(ids["a:0"], 0)
    assert planner.training_finished
    actions = planner.worker_exited(ids["a:1"], 3, in_final_world=False)
    assert _said(actions) == [
        "worker on a (pid 101) exited with code 3 after training finished; it started after "
        "the last generation formed, so it had no part in the training and does not decide "
        "the exit code"]
    # Unknown (no event log) counts, as does a member of the final world.
    planner.worker_exited(ids["a:2"], 4, in_final_world=None)
    assert planner.tick() == [Finish(4)]


def test_stopping_the_poller_kills_a_discovery_script_still_running(tmp_path: Path) -> None:
    pid_file = tmp_path / "script.pid"
    script = f"echo $$ > {pid_file}.tmp && mv {pid_file}.tmp {pid_file} && exec sleep 30"
    poller = HostPoller(functools.partial(run_discovery_script, script), interval=60)
    poller.start()
    deadline = time.monotonic() + 10
    while not pid_file.exists():
        assert time.monotonic() < deadline, "the script never started"
        time.sleep(0.02)
    pid = int(pid_file.read_text())
    poller.stop()
    deadline = time.monotonic() + 5
    while not pid_gone(pid):
        assert time.monotonic() < deadline, "the script outlived the poller"
        time.sleep(0.02)


def test_no_worker_left_and_every_host_blacklisted_for_good_fails_at_once() -> None:
    planner, clock = _planner(num_proc=2, min_np=2, timeout=600)
    planner.hosts_discovered(_hosts("a:1,b:1"))
    ids = _run(planner, planner.tick())
    planner.worker_exited(ids["a:0"], 1, error="RuntimeError: boom on a")
    assert planner.tick() == []  # b still runs
    planner.worker_exited(ids["b:0"], 1, error="RuntimeError: boom on b")
    assert planner.tick() == []  # discovery has not answered since
    clock.advance(1)
    planner.hosts_discovered(_hosts("a:1,b:1"))
    actions = planner.tick()
    assert actions[-1] == Finish(1)
    assert _said(actions) == [
        "no worker is left and none can start: every discovered host (a, b) is blacklisted "
        "for good (see --blacklist-cooldown-range) and host discovery offers no other; the "
        "last failure: worker b:0 (pid 101) exited with code 1: RuntimeError: boom on b"]


def test_a_new_host_in_the_next_discovery_keeps_a_stranded_job_going() -> None:
    planner, _ = _planner(num_proc=1, min_np=1, timeout=600)
    planner.hosts_discovered(_hosts("a:1"))
    ids = _run(planner, planner.tick())
    planner.worker_exited(ids["a:0"], 1)
    assert planner.tick() == []
    planner.hosts_discovered(_hosts("a:1,b:1"))
    assert _starts(planner.tick()) == ["b:0"]
    assert not planner.done


def test_with_a_cooldown_a_stranded_job_waits_for_its_hosts() -> None:
    planner, clock = _planner(num_proc=1, min_np=1, timeout=600, cooldown=(5, 5))
    planner.hosts_discovered(_hosts("a:1"))
    ids = _run(planner, planner.tick())
    planner.worker_exited(ids["a:0"], 1)
    for _ in range(3):
        clock.advance(1)
        planner.hosts_discovered(_hosts("a:1"))
        assert planner.tick() == []
    clock.advance(2)
    assert _starts(planner.tick()) == ["a:0"]


def test_hosts_that_all_went_away_are_waited_for() -> None:
    planner, clock = _planner(num_proc=1, min_np=1, timeout=600)
    planner.hosts_discovered(_hosts("a:1"))
    _run(planner, planner.tick())
    planner.hosts_discovered([])
    planner.worker_exited(0, -15)  # stopped by us
    for _ in range(3):
        clock.advance(1)
        planner.hosts_discovered([])
        assert planner.tick() == []
