"""Leases sized to the load (pure: no servers, a fake clock), pinned at 10 to 10k members."""

from __future__ import annotations

import pytest
from coordinator_transitions import form

from hora_coordinator import state

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

# The coordinator's defaults: 2 s leases, 0.5 s heartbeats, 2,000 heartbeats/s.
POLICY = state.LeasePolicy(shortest_lease_s=2.0, shortest_interval_s=0.5, heartbeats_per_s=2000)


def rate(plan: dict[str, state.Lease], members: dict[str, int]) -> float:
    """Heartbeats per second the plan asks of all members together."""
    return sum(n / plan[job].interval_s for job, n in members.items())


@pytest.mark.parametrize("total", [10, 100, 1_000])
def test_a_lightly_loaded_coordinator_gives_every_member_the_shortest_lease(total):
    members = {f"job{j}": total // 10 for j in range(10)}
    plan = state.plan_leases(members, POLICY)
    assert set(plan.values()) == {state.Lease(0.5, 2.0)}


@pytest.mark.parametrize(("jobs", "per_job"), [(1, 10_000), (100, 100), (10, 1_000)])
def test_past_the_budget_intervals_and_leases_grow_in_proportion(jobs, per_job):
    members = {f"job{j}": per_job for j in range(jobs)}
    plan = state.plan_leases(members, POLICY)
    assert rate(plan, members) == pytest.approx(2000)
    for lease in plan.values():  # 10,000 members at 2,000/s: every 5 s, for 4 intervals
        assert lease.interval_s == pytest.approx(5.0)
        assert lease.lease_s == pytest.approx(20.0)


def test_a_small_job_keeps_the_shortest_lease_beside_a_huge_one():
    members = {"huge": 20_000, "small": 3}
    plan = state.plan_leases(members, POLICY)
    assert plan["small"] == state.Lease(0.5, 2.0)
    assert plan["huge"].interval_s == pytest.approx(20_000 / (2000 - 6))
    assert rate(plan, members) == pytest.approx(2000)


@pytest.mark.parametrize("sizes", [[1, 5000, 7000], [300] * 40, [2] * 5000, [9999, 1]])
def test_no_plan_asks_more_than_the_budget(sizes):
    members = {f"job{i}": n for i, n in enumerate(sizes)}
    plan = state.plan_leases(members, POLICY)
    assert rate(plan, members) <= 2000 * (1 + 1e-9)
    for lease in plan.values():
        assert lease.lease_s >= 4 * lease.interval_s - 1e-9
        assert lease.interval_s >= 0.5 and lease.lease_s >= 2.0


def test_the_shortest_interval_is_at_most_a_quarter_of_the_lease():
    policy = state.LeasePolicy(shortest_lease_s=1.0, shortest_interval_s=0.5,
                               heartbeats_per_s=2000)
    assert policy.fastest == state.Lease(0.25, 1.0)
    long = state.LeasePolicy(shortest_lease_s=30.0, shortest_interval_s=0.5,
                             heartbeats_per_s=2000)
    assert long.fastest == state.Lease(0.5, 30.0)


def test_heartbeating_members_are_the_active_ones():
    job = form(3)
    assert state.heartbeating_members(job) == 3
    state.leave(job, "w2", "shutdown", 1.0)
    assert state.heartbeating_members(job) == 2


def test_a_member_is_judged_on_the_lease_it_was_granted_when_the_plan_shrinks():
    # Granted 20 s (a loaded coordinator: one heartbeat every 5 s); the load
    # then drops and the job's lease is 2 s. The member still renews every 5 s
    # until its next answer tells it otherwise: 4 s of silence must not lose it.
    job = form(2, now=0.0)
    state.heartbeat(job, "w0", 1.0, lease_s=20.0, interval_s=5.0)
    state.heartbeat(job, "w1", 1.0, lease_s=20.0, interval_s=5.0)
    assert state.check(job, 5.0, lease_s=2.0) == []
    # Its next heartbeat grants the short lease, which then holds.
    state.heartbeat(job, "w0", 6.0, lease_s=2.0, interval_s=0.5)
    state.heartbeat(job, "w1", 6.0, lease_s=2.0, interval_s=0.5)
    state.heartbeat(job, "w0", 8.0, lease_s=2.0, interval_s=0.5)
    state.check(job, 8.5, lease_s=2.0)
    assert job.members[1].state is state.MemberState.LOST
    assert job.members[1].cause == "lease expired (no heartbeat for 2.5 s)"


def test_a_lease_that_grows_applies_at_once():
    job = form(2, now=0.0)
    state.heartbeat(job, "w0", 1.0, lease_s=2.0, interval_s=0.5)
    state.heartbeat(job, "w1", 1.0, lease_s=2.0, interval_s=0.5)
    assert state.check(job, 4.0, lease_s=8.0) == []


def test_a_heartbeat_reply_asks_for_the_interval():
    job = form(2)
    reply = state.heartbeat(job, "w0", 1.0, lease_s=20.0, interval_s=5.0)
    assert (reply.lease_ms, reply.interval_ms) == (20_000, 5_000)
    assert state.heartbeat(job, "w0", 1.0, lease_s=2.0).interval_ms == 500
