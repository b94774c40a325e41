"""Carrying out an elastic job: processes, signals, discovery and events.

:class:`ElasticSupervisor` is the executor for :class:`.elastic.ElasticPlanner`:
every :data:`.procs.POLL_INTERVAL` it hands the planner what happened (a new
host list from the :class:`.discovery.HostPoller`, workers that exited) and
carries out the actions it answers. It decides nothing itself beyond what
the static supervisor does too: forwarding SIGINT/SIGTERM, and SIGKILL for a
worker still running a grace period after it was asked to stop.

Output lines carry the worker's ``host:slot`` (``[127.0.0.2:0]<stdout>:``),
horovodrun's elastic style: ranks change with every generation, a slot does
not. A replacement on the same slot continues that label, and with
``--output-filename`` appends to the same ``DIR/host:slot/`` files.
"""

from __future__ import annotations

import math
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .discovery import HostPoller
from .elastic import (
    Action,
    ElasticPlanner,
    Finish,
    ReportEvent,
    Say,
    StartWorker,
    StopWorker,
)
from .procs import (
    GRACE_PERIOD,
    POLL_INTERVAL,
    REAP_TIMEOUT,
    SignalRecorder,
    WorkerOutput,
    plural,
    signal_group,
    signal_name,
)

if TYPE_CHECKING:  # gRPC is imported only when an elastic job runs
    from .events import EventReporter

__all__ = ["ElasticSupervisor"]


@dataclass
class _Proc:
    worker_id: int
    host: str
    label: str
    proc: subprocess.Popen[bytes]
    # Wall-clock start, ms since the Unix epoch, to compare with the
    # coordinator's event times.
    started_ms: int
    # When SIGKILL is due (it was asked to stop), math.inf once it was sent.
    kill_at: float | None = None
    killed_at: float | None = None


class ElasticSupervisor:
    """Runs an elastic job until the planner finishes it or a signal stops it.

    Args:
        planner: decides what happens (see :mod:`.elastic`).
        poller: supplies host lists; started and stopped by :meth:`run`.
        make_env: the whole environment of a worker on a given host.
        argv: the worker command.
        output: starts workers and forwards their output; says messages.
        reporter: records events at the coordinator (None: not recorded).
        grace_period: seconds between SIGTERM (or a forwarded signal) and SIGKILL.
        verbose: also announce the workers of the initial start.
        same_clock: the coordinator runs on this machine, so the times in its
            event log compare with this process's clock (needed to tell
            whether a worker failing after training finished was part of
            the final world).
    """

    def __init__(self, planner: ElasticPlanner, poller: HostPoller,
                 make_env: Callable[[str], Mapping[str, str]], argv: Sequence[str], *,
                 output: WorkerOutput, reporter: EventReporter | None = None,
                 grace_period: float = GRACE_PERIOD, verbose: bool = False,
                 same_clock: bool = True) -> None:
        self._planner = planner
        self._poller = poller
        self._make_env = make_env
        self._argv = list(argv)
        self._output = output
        self._reporter = reporter
        self._grace = grace_period
        self._verbose = verbose
        self._same_clock = same_clock
        self._signals = SignalRecorder()
        self._procs: dict[int, _Proc] = {}
        self._hosts_version = 0
        self._ignored_hosts: set[str] = set()
        self._exit_code: int | None = None
        self._stopping_all = False
        self._hurried = False

    # -- doing what the planner says ---------------------------------------------

    def _apply(self, actions: Sequence[Action]) -> None:
        for action in actions:
            if isinstance(action, StartWorker):
                self._start(action)
            elif isinstance(action, StopWorker):
                proc = self._procs.get(action.worker_id)
                if proc is not None:
                    self._terminate(proc, signal.SIGTERM)
            elif isinstance(action, Say):
                self._output.say(action.message)
            elif isinstance(action, ReportEvent):
                if self._reporter is not None:
                    self._reporter.report(action.kind, action.host, action.message)
            elif isinstance(action, Finish):
                self._finish(action.code)

    def _start(self, action: StartWorker) -> None:
        try:
            proc = self._output.spawn(action.label, self._argv, self._make_env(action.host),
                                      action.label, host=action.host, append=True)
        except OSError as exc:
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            self._apply(self._planner.worker_start_failed(action.worker_id, code, str(exc)))
            return
        self._procs[action.worker_id] = _Proc(action.worker_id, action.host, action.label, proc,
                                              int(time.time() * 1000))
        self._planner.worker_running(action.worker_id, proc.pid)
        if action.announce or self._verbose:
            message = f"started worker {action.label} (pid {proc.pid})"
            self._output.say(message)
            if action.announce and self._reporter is not None:
                self._reporter.report("worker_started", action.host, message)

    def _terminate(self, proc: _Proc, signum: int) -> None:
        signal_group(proc.proc.pid, signum)
        if proc.kill_at is None:
            proc.kill_at = time.monotonic() + self._grace

    def _finish(self, code: int) -> None:
        if self._exit_code is None:
            self._exit_code = code
        self._stopping_all = True
        for proc in list(self._procs.values()):
            self._terminate(proc, signal.SIGTERM)

    # -- what happened ----------------------------------------------------------------

    def _take_hosts(self) -> None:
        latest = self._poller.latest()
        if latest is None or latest[0] == self._hosts_version:
            return
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
        self._apply(self._planner.hosts_discovered(usable))

    def _poll(self) -> None:
        for worker_id, proc in list(self._procs.items()):
            returncode = proc.proc.poll()
            if returncode is None:
                continue
            del self._procs[worker_id]
            in_final_world = None
            if (returncode != 0 and self._planner.training_finished
                    and self._reporter is not None and self._same_clock):
                # Rare (a failure after training finished), so a blocking
                # read of the event log with a short deadline is fine here.
                formed = self._reporter.last_generation_ms()
                if formed is not None:
                    in_final_world = proc.started_ms <= formed
            error = self._output.last_error(proc.proc.pid) if returncode != 0 else ""
            self._apply(self._planner.worker_exited(worker_id, returncode,
                                                    in_final_world=in_final_world,
                                                    error=error))

    def _handle_signals(self) -> None:
        for signum in self._signals.take():
            if not self._stopping_all:
                self._planner.shutdown()
                if self._exit_code is None:
                    self._exit_code = 128 + signum
                self._output.say(f"received {signal_name(signum)}; forwarding it to "
                                 f"{plural(len(self._procs), 'worker')}")
                self._stopping_all = True
                for proc in self._procs.values():
                    self._terminate(proc, signum)
            else:
                # A second Ctrl-C means "now": skip the rest of the grace period.
                self._output.say(f"received {signal_name(signum)} again; "
                                 f"not waiting any longer")
                self._hurried = True
                for proc in self._procs.values():
                    if proc.kill_at != math.inf:  # not SIGKILLed yet
                        proc.kill_at = time.monotonic()

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        due = [p for p in self._procs.values() if p.kill_at is not None and p.kill_at <= now]
        if due:
            after = "" if self._hurried else f" after {self._grace:g} s"
            names = ", ".join(f"{p.label} (pid {p.proc.pid})" for p in due)
            self._output.say(f"{plural(len(due), 'worker')} still running{after}; "
                             f"killing {names}")
            for proc in due:
                signal_group(proc.proc.pid, signal.SIGKILL)
                proc.kill_at = math.inf
                proc.killed_at = now
        for worker_id, proc in list(self._procs.items()):
            if proc.killed_at is not None and now - proc.killed_at > REAP_TIMEOUT:
                self._output.say(f"worker {proc.label} (pid {proc.proc.pid}) did not exit "
                                 f"after SIGKILL; giving up on it")
                del self._procs[worker_id]

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> int:
        """Supervises the job until it ends.

        Returns:
            The planner's exit code (0 when training finished and every
            worker exited 0), 127/126 when the command cannot be started, or
            128+N when horarun itself got signal N.
        """
        self._signals.install()
        self._poller.start()
        try:
            while True:
                self._handle_signals()
                if not self._stopping_all:
                    self._take_hosts()
                self._poll()
                if not self._stopping_all:
                    self._apply(self._planner.tick())
                self._enforce_deadlines()
                if self._stopping_all and not self._procs:
                    break
                time.sleep(POLL_INTERVAL)
            self._output.drain()
        finally:
            self._poller.stop()
            # Never leave workers behind, whatever went wrong above.
            deadline = time.monotonic() + REAP_TIMEOUT
            for proc in self._procs.values():
                signal_group(proc.proc.pid, signal.SIGKILL)
            for proc in self._procs.values():
                try:
                    proc.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            self._signals.restore()
        return self._exit_code if self._exit_code is not None else 0
