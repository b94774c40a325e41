"""The coordinator's periodic work: the lease and stall check, its own backlog, samples,
and forgetting jobs that are over (a part of :class:`~.coordinator.Coordinator`).

gRPC core queues calls until the event loop takes them, and the loop itself
may stall: this part measures both, so that no worker is judged on the
coordinator's own delays, and it runs every check on the loop's clock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from . import state
from .runtime import JobRuntime, Jobs
from .settings import CoordinatorSettings

__all__ = ["SAMPLE_INTERVAL_S", "PeriodicChecks"]

logger = logging.getLogger("hora_coordinator")

#: How often running jobs are sampled for their series (seconds).
SAMPLE_INTERVAL_S = 1.0


class PeriodicChecks:
    """The coordinator's periodic check, backlog and retention (mixed into it)."""

    settings: CoordinatorSettings
    clock: Callable[[], float]
    jobs: Jobs
    runtimes: dict[str, JobRuntime]
    lease_policy: state.LeasePolicy
    _backlog_s: float
    _probe_started: float | None
    apply: Callable[[state.Job, Iterable[state.Effect]], None]
    lease_of: Callable[[state.Job], state.Lease]
    deliver_notices: Callable[[], None]
    _forget: Callable[[str], None]

    def check(self) -> None:
        """Sizes leases to the load, expires leases and reports stalled tensors of
        every running job, and runs the deadlines of every elastic round that gathers."""
        now = self.clock()
        self.deliver_notices()
        leases = state.plan_leases(
            {job.job_id: state.heartbeating_members(job) for job in self.jobs.values()},
            self.lease_policy,
        )
        for job_id, runtime in self.runtimes.items():
            runtime.lease = leases.get(job_id)
        backlog = self.backlog_s()
        for job in list(self.jobs.values()):
            if job.phase is state.JobPhase.RUNNING or job.round is not None:
                lease_s = self.lease_of(job).lease_s + backlog
                self.apply(job, state.check(job, now, lease_s))
            self._forget_if_abandoned(job)
            self._forget_if_done(job, now)

    def forgive_stall(self, stalled_s: float) -> None:
        """The event loop did not run for ``stalled_s`` seconds: no lease or stall
        clock counts that time (the heartbeats sent meanwhile are not read yet)."""
        logger.warning("hora-coordinator: the event loop stalled for %.1f s; leases and "
                       "stall clocks are extended by as much", stalled_s)
        for job in self.jobs.values():
            state.forgive_stall(job, stalled_s)

    def backlog_s(self) -> float:
        """How long a call waits before the coordinator takes it: the last self-check's
        round trip, or the age of the one still unanswered if that is longer."""
        started = self._probe_started
        if started is None:
            return self._backlog_s
        return max(self._backlog_s, asyncio.get_running_loop().time() - started)

    async def measure_backlog(self, probe: Callable[[], Awaitable[object]]) -> None:
        """Times ``probe`` (a health check the coordinator makes to itself) every
        ``stall_check_interval`` until cancelled.

        gRPC core queues calls until the event loop takes them, one at a time: when
        thousands of workers start at once (Join, store, heartbeat calls), a call can
        wait seconds in that queue while the loop itself never stalls. A heartbeat
        that waits there has arrived; every lease is judged that much longer
        (:meth:`check`), so the coordinator's own backlog never costs a healthy
        worker its place.
        """
        interval = self.settings.stall_check_interval.total_seconds()
        loop = asyncio.get_running_loop()
        while True:
            started = self._probe_started = loop.time()
            try:
                await probe()
            except Exception:  # a failed self-check says nothing about the backlog
                logger.debug("the coordinator's self-check failed", exc_info=True)
            else:
                self._backlog_s = loop.time() - started
            finally:
                self._probe_started = None
            await asyncio.sleep(interval)

    async def run_checks(self) -> None:
        """Runs :meth:`check` every ``stall_check_interval`` until cancelled.

        A tick that comes more than one period late means the loop itself
        stalled; the lateness is forgiven (:meth:`forgive_stall`) before the
        check judges leases, so workers are judged on heartbeats that could
        arrive, not on the coordinator's own pause.
        """
        interval = self.settings.stall_check_interval.total_seconds()
        loop = asyncio.get_running_loop()
        last = loop.time()
        sampled = last
        while True:
            await asyncio.sleep(interval)
            late = loop.time() - last - interval
            try:
                if late > interval:
                    self.forgive_stall(late)
                self.check()
                if loop.time() - sampled >= SAMPLE_INTERVAL_S:
                    sampled = loop.time()
                    self.sample()
            except Exception:  # a bug in one check must not stop every later one
                logger.exception("periodic check failed")
            # From the check's end: a slow check is not the loop stalling, and
            # counting it would make every later tick look late.
            last = loop.time()

    def sample(self) -> None:
        """Adds each running job's sample to its series (see :mod:`.state.telemetry`)."""
        now = self.clock()
        for job in self.jobs.values():
            state.sample_job(job, now)

    def _forget_if_abandoned(self, job: state.Job) -> None:
        """Drops a job whose first world never formed and that nobody waits to join.

        Its joiners went away (deadline, cancel, Leave): nothing of it is left to
        keep, and a coordinator that kept such jobs would grow without bound.
        """
        if state.abandoned(job) and self.jobs.get(job.job_id) is job:
            self._forget(job.job_id)
            logger.info("job %s: every joiner went away before its world formed; forgotten",
                        job.job_id)

    def _forget_if_done(self, job: state.Job, now: float) -> None:
        """Drops a job that ended ``job_retention`` ago with nothing of it left.

        Nothing left: no gathering round, no waiting Join, no open stream. A
        worker that joins the same job id later starts a new job.
        """
        job_id = job.job_id
        runtime = self.runtimes.get(job_id)
        if runtime is None or runtime.job is not job:
            return
        done = (job.phase in (state.JobPhase.FINISHED, state.JobPhase.FAILED)
                and job.round is None
                and not runtime.joins
                and not runtime.open_streams)
        if not done:
            runtime.ended_since = None
            return
        if runtime.ended_since is None:
            runtime.ended_since = now
        since = runtime.ended_since
        if now - since < self.settings.job_retention.total_seconds():
            return
        self._forget(job_id)
        logger.info("job %s %s; forgotten after %g s", job_id, job.phase.value,
                    self.settings.job_retention.total_seconds())

    def _forget_first_ended(self) -> bool:
        """Forgets the job that ended first, before its retention, to make room; whether any."""
        ended = {job_id: runtime.ended_since for job_id, runtime in self.runtimes.items()
                 if runtime.ended_since is not None}
        first = min(ended, key=ended.__getitem__, default=None)
        if first is not None:
            self._forget(first)
            logger.info("job %s ended; forgotten early to make room (max_jobs)", first)
        return first is not None
