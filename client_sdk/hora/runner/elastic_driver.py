"""An elastic job on the supervisor: discovery, events and the elastic planner.

:class:`ElasticDriver` is the :class:`.supervisor.Planner` of an elastic
job. It owns nothing but the wiring: it hands :class:`.elastic.ElasticPlanner`
what happened (a new host list from the :class:`.discovery.HostPoller`,
workers that started or exited), turns the worker starts the planner
decides into :class:`.supervisor.Spawn`, and records events at the
coordinator. Processes, signals and deadlines are the supervisor's.

Output lines carry the worker's ``host:slot`` (``[127.0.0.2:0]<stdout>:``),
horovodrun's elastic style: ranks change with every generation, a slot does
not. A replacement on the same slot continues that label, and with
``--output-filename`` appends to the same ``DIR/host:slot/`` files.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from .discovery import HostPoller
from .elastic import Action as Decision
from .elastic import ElasticPlanner, ReportEvent, StartWorker
from .output import WorkerOutput
from .supervisor import GRACE_PERIOD, Action, Exit, Say, Spawn, Supervisor

if TYPE_CHECKING:  # gRPC is imported only when an elastic job runs
    from .events import EventReporter, GenerationWatch

__all__ = ["ElasticDriver"]


class ElasticDriver:
    """Runs an elastic job until the planner finishes it or a signal stops it.

    Args:
        planner: decides what happens (see :mod:`.elastic`).
        poller: supplies host lists; started and stopped by :meth:`run`.
        make_env: the whole environment of the worker a :class:`.elastic.StartWorker`
            starts (its host and its slot's placement).
        argv: the worker command.
        output: starts workers and forwards their output; says messages.
        reporter: records events at the coordinator (None: not recorded).
        generations: reads the job's generation at the coordinator, for the
            reset limit (None: not read, no limit enforced here).
        grace_period: seconds between SIGTERM (or a forwarded signal) and SIGKILL.
        verbose: also announce the workers of the initial start.
        same_clock: the coordinator runs on this machine, so the times in its
            event log compare with this process's clock (needed to tell
            whether a worker failing after training finished was part of
            the final world).
    """

    kill_prefix = ""

    def __init__(self, planner: ElasticPlanner, poller: HostPoller,
                 make_env: Callable[[StartWorker], Mapping[str, str]], argv: Sequence[str],
                 *, output: WorkerOutput, reporter: EventReporter | None = None,
                 generations: GenerationWatch | None = None,
                 grace_period: float = GRACE_PERIOD, verbose: bool = False,
                 same_clock: bool = True) -> None:
        self._planner = planner
        self._poller = poller
        self._make_env = make_env
        self._argv = list(argv)
        self._output = output
        self._reporter = reporter
        self._generations = generations
        self._grace = grace_period
        self._verbose = verbose
        self._same_clock = same_clock
        # Starts decided and not yet carried out, by worker id.
        self._starting: dict[int, StartWorker] = {}
        # Wall-clock start of each running worker, ms since the Unix epoch,
        # to compare with the coordinator's event times.
        self._started_ms: dict[int, int] = {}
        self._hosts_version = 0
        self._ignored_hosts: set[str] = set()

    def run(self) -> int:
        """Supervises the job until it ends.

        Returns:
            The planner's exit code (0 when training finished and every
            worker exited 0), 127/126 when the command cannot be started, or
            128+N when horarun itself got signal N.
        """
        self._poller.start()
        if self._generations is not None:
            self._generations.start()
        try:
            return Supervisor(self, self._output, grace_period=self._grace).run()
        finally:
            self._poller.stop()
            if self._generations is not None:
                self._generations.stop()

    # -- the supervisor's questions ----------------------------------------------------

    def step(self, exits: Sequence[Exit]) -> list[Action]:
        """New hosts first, then the exits, then whatever is due now."""
        decisions = self._take_hosts()
        if self._generations is not None:
            decisions += self._planner.generation_formed(self._generations.latest())
        for ended in exits:
            decisions += self._exited(ended)
        decisions += self._planner.tick()
        return self._carry_out(decisions)

    def started(self, worker_id: int, pid: int) -> list[Action]:
        """Tells the planner; announces a replacement or a newcomer."""
        self._started_ms[worker_id] = int(time.time() * 1000)
        self._planner.worker_running(worker_id, pid)
        start = self._starting.pop(worker_id)
        if not (start.announce or self._verbose):
            return []
        message = f"started worker {start.label} (pid {pid})"
        if start.announce and self._reporter is not None:
            self._reporter.report("worker_started", start.host, message)
        return [Say(message)]

    def start_failed(self, worker_id: int, code: int, error: str) -> list[Action]:
        """Asks the planner (which fails the job)."""
        self._starting.pop(worker_id, None)
        return self._carry_out(self._planner.worker_start_failed(worker_id, code, error))

    def interrupted(self) -> None:
        """Tells the planner to decide nothing more."""
        self._planner.shutdown()

    # -- between the two ---------------------------------------------------------------

    def _take_hosts(self) -> list[Decision]:
        latest = self._poller.latest()
        if latest is None or latest[0] == self._hosts_version:
            return []
        self._hosts_version, hosts = latest
        usable = []
        for host in hosts:
            if self._output.can_start_on(host.hostname):
                usable.append(host)
            elif host.hostname not in self._ignored_hosts:
                self._ignored_hosts.add(host.hostname)
                self._output.say(f"discovered host {host.hostname} is not this machine, and "
                                 f"the coordinator listens on loopback only; ignoring it "
                                 f"(pass --network-interface to run across machines)")
        return self._planner.hosts_discovered(usable)

    def _exited(self, ended: Exit) -> list[Decision]:
        started_ms = self._started_ms.pop(ended.worker_id, 0)
        failed = ended.returncode != 0
        if self._generations is not None and not self._planner.done:
            # First make sure no reset beyond the limit came in since the last
            # read: training may have finished in it, or its members stopped
            # for it (rare, so a blocking read is fine).
            over = self._planner.generation_formed(self._generations.read_now())
            if over:
                return over
        in_final_world = None
        if (failed and self._planner.training_finished
                and self._reporter is not None and self._same_clock):
            # Rare (a failure after training finished), so a blocking
            # read of the event log with a short deadline is fine here.
            formed = self._reporter.last_generation_ms()
            if formed is not None:
                in_final_world = started_ms <= formed
        error = self._output.last_error(ended.pid) if failed else ""
        return self._planner.worker_exited(ended.worker_id, ended.returncode,
                                           in_final_world=in_final_world, error=error)

    def _carry_out(self, decisions: Sequence[Decision]) -> list[Action]:
        """Records the events; turns the rest into the supervisor's actions."""
        actions: list[Action] = []
        for decision in decisions:
            if isinstance(decision, StartWorker):
                self._starting[decision.worker_id] = decision
                actions.append(Spawn(decision.worker_id, decision.host, self._argv,
                                     self._make_env(decision), label=decision.label,
                                     name=f"worker {decision.label}",
                                     output_name=decision.label, append=True))
            elif isinstance(decision, ReportEvent):
                if self._reporter is not None:
                    self._reporter.report(decision.kind, decision.host, decision.message)
            else:
                actions.append(decision)
        return actions
