"""Leases sized to the load: how often members renew, and how long a lease lasts.

Every heartbeat costs the coordinator CPU (about 0.1 ms on its negotiation
stream, measured in bench/README.md), so heartbeats at a fixed cadence cap the
members one coordinator can serve. A lease must also be short, or a stopped
worker (SIGSTOP, a host gone without closing its sockets) goes unnoticed
until it runs out. Both hold when the cadence follows the load:

- The coordinator spends at most ``heartbeats_per_s`` on heartbeats in all.
  While its members together stay within it, every member renews at the
  shortest interval and holds the shortest lease.
- Past it, the budget is shared out between jobs max-min fairly: a job that
  asks for less than an equal share keeps its shortest interval, the others
  split what remains. So a small job keeps fast failure detection on a
  crowded coordinator, and a large one stretches its interval instead.
- A lease lasts ``intervals_per_lease`` intervals, never less than the
  shortest lease: a few heartbeats late (a busy worker, a slow network) never
  cost a member its place.

A plan is a pure function of the members each job has; the coordinator
recomputes it at every periodic check and tells each member its interval in
every heartbeat answer. A member is judged on the longer of the lease it was
last told and the job's current one, so a plan that shrinks never expires a
member that still renews at the old, slower cadence.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .job import Job, JobPhase, Member, MemberState

__all__ = ["Lease", "LeasePolicy", "expired", "heartbeating_members", "plan_leases"]


@dataclass(frozen=True)
class Lease:
    """How often a job's members renew, and how long a renewal keeps them.

    Attributes:
        interval_s: Seconds between a member's heartbeats.
        lease_s: Seconds a member lives after its last heartbeat or stream message.
    """

    interval_s: float
    lease_s: float


@dataclass(frozen=True)
class LeasePolicy:
    """The coordinator's settings for :func:`plan_leases`.

    Attributes:
        shortest_lease_s: The lease while the coordinator is lightly loaded.
        shortest_interval_s: The heartbeat interval while it is lightly loaded
            (at most ``shortest_lease_s / intervals_per_lease``).
        heartbeats_per_s: Heartbeats per second all members together may send.
        intervals_per_lease: How many intervals a lease lasts.
    """

    shortest_lease_s: float
    shortest_interval_s: float
    heartbeats_per_s: float
    intervals_per_lease: int = 4

    def __post_init__(self) -> None:
        if self.shortest_lease_s <= 0 or self.shortest_interval_s <= 0:
            raise ValueError("the shortest lease and interval must be positive")
        if self.heartbeats_per_s <= 0 or self.intervals_per_lease < 1:
            raise ValueError("the heartbeat budget and intervals per lease must be positive")

    @property
    def fastest(self) -> Lease:
        """The lease of a lightly loaded coordinator."""
        interval = min(self.shortest_interval_s, self.shortest_lease_s / self.intervals_per_lease)
        return Lease(interval, self.shortest_lease_s)

    def lease_for(self, interval_s: float) -> Lease:
        """The lease that goes with members renewing every ``interval_s``."""
        interval = max(interval_s, self.fastest.interval_s)
        return Lease(interval, max(self.shortest_lease_s, self.intervals_per_lease * interval))


def expired(member: Member, now: float, lease_s: float) -> bool:
    """Whether ``member`` has been silent longer than its lease: the longer of the
    one its last heartbeat answer granted and the job's current ``lease_s``."""
    return now - member.last_heartbeat > max(member.lease_s, lease_s)


def heartbeating_members(job: Job) -> int:
    """Members of ``job`` that renew a lease: the active ones of a running generation,
    and those of an ended elastic generation that the next round still awaits."""
    if job.phase is JobPhase.RUNNING:
        return sum(1 for m in job.members if m.state is MemberState.ACTIVE)
    if job.round is not None:
        return len(job.round.expected - job.round.joiners.keys())
    return 0


def plan_leases(members: Mapping[str, int], policy: LeasePolicy) -> dict[str, Lease]:
    """Each job's lease, given how many of its members renew (job id -> count).

    Max-min fair: jobs are served smallest first, each taking the rate it asks
    for (its members at the shortest interval) or an equal share of what is
    left, whichever is less. O(jobs log jobs).
    """
    fastest = policy.fastest
    plan: dict[str, Lease] = {}
    left = policy.heartbeats_per_s
    waiting = sorted((n, job_id) for job_id, n in members.items())
    for index, (count, job_id) in enumerate(waiting):
        if count <= 0:
            plan[job_id] = fastest
            continue
        share = left / (len(waiting) - index)
        wanted = count / fastest.interval_s
        rate = min(wanted, share)
        left -= rate
        plan[job_id] = fastest if rate >= wanted else policy.lease_for(count / rate)
    return plan
