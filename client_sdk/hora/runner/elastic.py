"""What an elastic ``horarun`` decides: which slot gets a worker, which host
is blacklisted and for how long, and when the job has failed or finished.

Everything here is pure: :class:`ElasticPlanner` is told what happened
(hosts discovered, a worker started or exited) and asked what to do next
(:meth:`ElasticPlanner.tick`); it answers with :data:`Action` values and
reads time only from the clock it was given. :mod:`.elastic_driver` carries
the actions out on the :mod:`.supervisor`, whose :class:`.supervisor.Say`,
:class:`.supervisor.StopWorker` and :class:`.supervisor.Finish` are among
them.

The rules:

As in Horovod 0.28.1 (``horovod/runner/elastic/driver.py`` and
``discovery.py``):

* **Start.** Nothing starts until the hosts offer ``num_proc`` usable slots
  (a usable slot is on a discovered host that is not blacklisted); then
  every usable slot gets a worker, up to ``max_np``. If ``num_proc`` slots
  do not appear within ``elastic_timeout`` the job fails.
* **Assignment.** Usable hosts are kept in an assignment order: hosts that
  stay keep their place, hosts that appear (or come back from a cooldown)
  are appended in discovery order, and a host that is blacklisted or no
  longer discovered leaves it. Ranks go host by host in that order, slot by
  slot, up to ``max_np``; each worker is started with the placement of its
  slot in the assignment of that moment (``HOROVOD_RANK``, ``HOROVOD_SIZE``,
  local and cross ranks: :class:`.hosts.SlotInfo`), which it keeps for life
  as its start rank. Every assigned slot without a worker gets one.
* **Failure.** A worker that exits non-zero before training has finished
  blacklists its host: the host's other workers are stopped and it gets no
  new workers (the coordinator opens a new generation without them). With
  a cooldown range ``(MIN, MAX)`` the host comes back after
  ``MIN * 2**n + U(0, 1) * MIN`` seconds, ``n`` its number of failures so
  far, held within ``[MIN, MAX]``; without one it is blacklisted for good.
* **Reset limit.** Every generation after the first is a reset (a host
  added, removed or failed); when the coordinator forms one more than
  ``reset_limit`` allows, the job fails, stopping its workers.
* **Removal.** Workers on a host that discovery no longer lists (or on a
  slot beyond a host's new slot count) are stopped; their exit is not a
  failure.
* **Too small.** When fewer than ``min_np`` workers run for
  ``elastic_timeout`` the job fails.
* **Hopeless.** When no worker is left, every discovered host is
  blacklisted for good (no cooldown range) and a further round of host
  discovery offers nothing new, no worker can ever start again: the job
  fails at once, quoting the last failure, instead of waiting out
  ``elastic_timeout``. With a cooldown range hosts come back, so the job
  waits as under *Too small*.
* **Finish.** The first worker to exit 0 means training is done: no more
  workers start, and the others get ``elastic_timeout`` to exit. The job
  then exits 0 if they all exit 0, else with the first non-zero code among
  them (1 when some were still running at the deadline). One exception: a
  worker known to have started after the job's last generation formed (a
  replacement or newcomer that never took part in the world that finished)
  does not decide the exit code; the driver tells from the
  coordinator's event log, and when it cannot tell, the failure counts.
"""

from __future__ import annotations

import enum
import math
import random
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .elastic_actions import ElasticPolicy, ReportEvent, StartWorker, cooldown_after
from .hosts import HostSlots, SlotInfo, assign_ranks
from .supervisor import Finish, Say, StopWorker, describe_exit, exit_code_of, plural

__all__ = [
    "Action",
    "ElasticPlanner",
    "ElasticPolicy",
    "Finish",
    "ReportEvent",
    "Say",
    "StartWorker",
    "StopWorker",
]

# Exit code of an elastic job that could not keep min_np workers.
ELASTIC_FAILURE = 1


Action = StartWorker | StopWorker | Say | ReportEvent | Finish


class _Phase(enum.Enum):
    WAITING = "waiting for num_proc slots"
    RUNNING = "running"
    FINISHING = "a worker finished; waiting for the others"
    DONE = "done"


@dataclass
class _Worker:
    host: str
    slot: int
    pid: int | None = None
    # Being stopped on purpose (its host left): its exit is not a failure,
    # and it no longer counts towards min_np.
    stopping: bool = False


@dataclass
class _HostRecord:
    failures: int = 0
    # When the host is usable again: math.inf for good, None when it is not
    # blacklisted.
    blacklisted_until: float | None = None
    # The last cooldown drawn, in seconds.
    cooldown: float = 0.0


class ElasticPlanner:
    """The decisions of an elastic job, with time from an injected clock.

    Args:
        policy: the job's limits.
        clock: seconds on a monotonic clock (default ``time.monotonic``).
        rng: draws cooldowns (default: a fresh ``random.Random()``).
    """

    def __init__(self, policy: ElasticPolicy, *, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self._policy = policy
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._timeout = policy.elastic_timeout.total_seconds()
        self._started_at = clock()
        self._phase = _Phase.WAITING
        self._hosts: dict[str, int] = {}
        # Usable hosts in assignment order (oldest first), as Horovod keeps them.
        self._order: list[str] = []
        self._records: dict[str, _HostRecord] = {}
        self._workers: dict[int, _Worker] = {}
        self._next_id = 0
        self._resets = 0
        self._below_min_since: float | None = None
        self._finish_by: float | None = None
        self._code_after_success: int | None = None
        # The last worker failure, as said in the final message.
        self._last_failure: str | None = None
        # Since when no worker is left and no host can take one (None: not
        # so), and whether host discovery has answered since.
        self._stranded_since: float | None = None
        self._discovered_while_stranded = False

    # -- views -----------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Whether the planner has said :class:`Finish` (or was shut down)."""
        return self._phase is _Phase.DONE

    @property
    def training_finished(self) -> bool:
        """Whether a worker has exited 0 and the others are being waited for."""
        return self._phase is _Phase.FINISHING

    @property
    def resets(self) -> int:
        """Generations formed after the first, as last told."""
        return self._resets

    def assignment(self) -> list[SlotInfo]:
        """The slots that should have workers now, by rank (Horovod's host assignment)."""
        hosts = [HostSlots(host, self._hosts[host]) for host in self._order]
        size = self._cap(sum(h.slots for h in hosts))
        return assign_ranks(hosts, size) if size > 0 else []

    def blacklisted(self, host: str) -> bool:
        """Whether ``host`` gets no new workers now."""
        record = self._records.get(host)
        return record is not None and record.blacklisted_until is not None

    def usable_slots(self) -> int:
        """Slots on discovered hosts that are not blacklisted."""
        return sum(n for host, n in self._hosts.items() if not self.blacklisted(host))

    def active_workers(self) -> int:
        """Workers started and not being stopped (what counts towards min_np)."""
        return sum(1 for w in self._workers.values() if not w.stopping)

    def _free_slots(self) -> list[SlotInfo]:
        taken = {(w.host, w.slot) for w in self._workers.values()}
        return [info for info in self.assignment()
                if (info.hostname, info.local_rank) not in taken]

    def _reorder(self) -> None:
        """Keeps the assignment order: survivors in place, newcomers appended."""
        usable = [host for host in self._hosts if not self.blacklisted(host)]
        kept = [host for host in self._order if host in usable]
        self._order = kept + [host for host in usable if host not in kept]

    def _cap(self, count: int) -> int:
        return count if self._policy.max_np is None else min(count, self._policy.max_np)

    # -- events ----------------------------------------------------------------

    def hosts_discovered(self, hosts: Sequence[HostSlots]) -> list[Action]:
        """The current host list (local hosts only, in discovery order).

        Returns:
            :class:`StopWorker` for each worker whose host (or slot) is gone,
            with a message and an event per host.
        """
        if self._phase is _Phase.DONE:
            return []
        if self._stranded_since is not None:
            self._discovered_while_stranded = True
        new = {h.hostname: h.slots for h in hosts}
        stops: list[Action] = []
        gone: dict[str, int] = {}
        for wid, worker in self._workers.items():
            if worker.stopping or worker.slot < new.get(worker.host, 0):
                continue
            worker.stopping = True
            gone[worker.host] = gone.get(worker.host, 0) + 1
            stops.append(StopWorker(wid))
        actions: list[Action] = []
        for host, count in gone.items():
            why = ("is no longer offered by host discovery" if host not in new
                   else f"now offers only {plural(new[host], 'slot')}")
            message = f"host {host} {why}; stopping {plural(count, 'worker')} there"
            actions += [Say(message), ReportEvent("host_removed", host, message)]
        actions += stops
        self._hosts = new
        self._reorder()
        return actions

    def generation_formed(self, generation: int) -> list[Action]:
        """The coordinator formed ``generation`` (1: the first world).

        Returns:
            :class:`Finish` (with a message) when the resets exceed the limit.
        """
        self._resets = max(self._resets, generation - 1)
        limit = self._policy.reset_limit
        if self._phase is not _Phase.RUNNING or limit is None or self._resets <= limit:
            return []
        self._phase = _Phase.DONE
        return [Say(f"reset limit {limit} exceeded: the worker set changed "
                    f"{self._resets} times (--reset-limit {limit}); stopping the job"),
                Finish(ELASTIC_FAILURE)]

    def worker_running(self, worker_id: int, pid: int) -> None:
        """The worker of a :class:`StartWorker` started as process ``pid``."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.pid = pid

    def worker_start_failed(self, worker_id: int, code: int, error: str) -> list[Action]:
        """The worker of a :class:`StartWorker` could not be started.

        Not the host's fault (the command is missing or not executable, which
        it would be on every local host), so the job fails with ``code``.
        """
        worker = self._workers.pop(worker_id, None)
        if worker is None or self._phase is _Phase.DONE:
            return []
        self._phase = _Phase.DONE
        return [Say(f"cannot start a worker on {worker.host}: {error}"), Finish(code)]

    def worker_exited(self, worker_id: int, returncode: int, *,
                      in_final_world: bool | None = None, error: str = "") -> list[Action]:
        """A worker's process ended with ``returncode`` (Popen's: -N for signal N).

        Args:
            worker_id: the worker of a :class:`StartWorker`.
            returncode: how it ended.
            in_final_world: for a failure after training finished, whether
                the worker started before the job's last generation formed
                (False: it cannot have been part of the world that finished,
                so its failure does not count); None when unknown.
            error: what the worker last wrote to stderr, for a failure (its
                exception line, for a Python worker).
        """
        worker = self._workers.pop(worker_id, None)
        if worker is None or worker.stopping or self._phase is _Phase.DONE:
            return []
        who = f"worker on {worker.host} (pid {worker.pid})"
        if returncode == 0:
            if self._phase is _Phase.FINISHING:
                return []
            self._phase = _Phase.FINISHING
            self._finish_by = self._clock() + self._timeout
            others = self.active_workers()
            if not others:
                return []
            return [Say(f"{who} finished training; starting no more workers and waiting "
                        f"up to {self._timeout:g} s for the other "
                        f"{plural(others, 'worker')}")]
        if self._phase is _Phase.FINISHING:
            if in_final_world is False:
                return [Say(f"{who} {describe_exit(returncode)} after training finished; "
                            f"it started after the last generation formed, so it had no "
                            f"part in the training and does not decide the exit code")]
            if self._code_after_success is None:
                self._code_after_success = exit_code_of(returncode)
            return [Say(f"{who} {describe_exit(returncode)} after training finished")]
        quote = f": {error}" if error else ""
        self._last_failure = (f"worker {worker.host}:{worker.slot} (pid {worker.pid}) "
                              f"{describe_exit(returncode)}{quote}")
        return self._blacklist(worker.host, f"{who} {describe_exit(returncode)}")

    def shutdown(self) -> None:
        """The supervisor stops everything (a signal): decide nothing more."""
        self._phase = _Phase.DONE

    def _blacklist(self, host: str, what: str) -> list[Action]:
        record = self._records.setdefault(host, _HostRecord())
        now = self._clock()
        if record.blacklisted_until is not None and record.blacklisted_until > now:
            return [Say(f"{what}; {host} is blacklisted already")]
        record.failures += 1
        suffix = ""
        if self._policy.cooldown_range is None:
            record.blacklisted_until = math.inf
        else:
            low, high = (d.total_seconds() for d in self._policy.cooldown_range)
            record.cooldown = cooldown_after(record.failures, low, high, self._rng.random())
            record.blacklisted_until = now + record.cooldown
            suffix = f" for {record.cooldown:.1f} s"
        self._reorder()
        # Horovod ends every worker of a failed host, not just the one that failed.
        mates = [wid for wid, w in self._workers.items() if w.host == host and not w.stopping]
        for wid in mates:
            self._workers[wid].stopping = True
        if mates:
            others = "worker" if len(mates) == 1 else f"{len(mates)} workers"
            suffix += f" and killing its other {others}"
        message = f"{what}; blacklisting {host}{suffix}"
        # SIGKILL, at once: they must be gone before the survivors re-form
        # the world, or it would form with them and break again.
        return [Say(message), ReportEvent("blacklist", host, message),
                *(StopWorker(wid, signal.SIGKILL) for wid in mates)]

    # -- time ------------------------------------------------------------------

    def tick(self) -> list[Action]:
        """What to do now: cooldowns over, workers to start, timeouts.

        Call it after reporting the events since the last call, and often
        (the driver does every 50 ms): deadlines are checked only here.
        """
        if self._phase is _Phase.DONE:
            return []
        now = self._clock()
        actions = self._end_cooldowns(now)
        if self._phase is _Phase.WAITING:
            actions += self._initial_start(now)
        elif self._phase is _Phase.RUNNING:
            actions += self._fill(announce=True)
            actions += self._check_stranded(now)
            if self._phase is _Phase.RUNNING:
                actions += self._check_min(now)
        elif self._phase is _Phase.FINISHING:
            actions += self._check_finished(now)
        return actions

    def _end_cooldowns(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for host, record in self._records.items():
            if record.blacklisted_until is not None and record.blacklisted_until <= now:
                record.blacklisted_until = None
                message = (f"host {host} is back after its {record.cooldown:.1f} s "
                           f"cooldown")
                actions += [Say(message), ReportEvent("cooldown_over", host, message)]
        if actions:
            self._reorder()
        return actions

    def _start(self, info: SlotInfo, announce: bool) -> StartWorker:
        worker_id = self._next_id
        self._next_id += 1
        self._workers[worker_id] = _Worker(info.hostname, info.local_rank)
        return StartWorker(worker_id, info.hostname, info.local_rank, announce, info)

    def _fill(self, announce: bool) -> list[Action]:
        free = self._free_slots()
        if self._policy.max_np is not None:
            # Workers being stopped still hold their process (and maybe their
            # place at the coordinator), so they count against max_np.
            free = free[:max(0, self._policy.max_np - len(self._workers))]
        return [self._start(info, announce) for info in free]

    def _initial_start(self, now: float) -> list[Action]:
        usable = self.usable_slots()
        if usable >= self._policy.start_count:
            self._phase = _Phase.RUNNING
            return self._fill(announce=False)
        if now - self._started_at >= self._timeout:
            self._phase = _Phase.DONE
            return [Say(f"elastic job needs at least {self._policy.start_count} workers; "
                        f"discovery offered {usable} usable slot(s) within "
                        f"{self._timeout:g} s"),
                    Finish(ELASTIC_FAILURE)]
        return []

    def _check_stranded(self, now: float) -> list[Action]:
        """Fails the job when no worker runs and none can ever start again."""
        # Hosts that all went away (rather than failed) may be replaced by
        # others, so only a list of failed hosts counts; and a cooldown that
        # will end brings its host back.
        records = self._records.values()
        stranded = (self.active_workers() == 0 and bool(self._hosts)
                    and all(self._records.get(host, _HostRecord()).blacklisted_until == math.inf
                            for host in self._hosts)
                    and not any(r.blacklisted_until not in (None, math.inf) for r in records))
        if not stranded:
            self._stranded_since = None
            self._discovered_while_stranded = False
            return []
        if self._stranded_since is None:
            self._stranded_since = now
            return []
        if not self._discovered_while_stranded:
            return []  # a host discovery answer may yet bring a new host
        self._phase = _Phase.DONE
        hosts = ", ".join(sorted(self._hosts)) or "none"
        last = f"; the last failure: {self._last_failure}" if self._last_failure else ""
        return [Say(f"no worker is left and none can start: every discovered host ({hosts}) "
                    f"is blacklisted for good (see --blacklist-cooldown-range) and host "
                    f"discovery offers no other{last}"),
                Finish(ELASTIC_FAILURE)]

    def _check_min(self, now: float) -> list[Action]:
        active = self.active_workers()
        if active >= self._policy.min_np:
            self._below_min_since = None
            return []
        if self._below_min_since is None:
            self._below_min_since = now
            return []
        if now - self._below_min_since < self._timeout:
            return []
        self._phase = _Phase.DONE
        return [Say(f"elastic job needs at least {self._policy.min_np} workers; only "
                    f"{active} running/available for {self._timeout:g} s"),
                Finish(ELASTIC_FAILURE)]

    def _check_finished(self, now: float) -> list[Action]:
        active = self.active_workers()
        if active == 0:
            self._phase = _Phase.DONE
            return [Finish(self._code_after_success or 0)]
        if self._finish_by is not None and now >= self._finish_by:
            self._phase = _Phase.DONE
            return [Say(f"{plural(active, 'worker')} still running {self._timeout:g} s "
                        f"after training finished; stopping them"),
                    Finish(self._code_after_success or ELASTIC_FAILURE)]
        return []
