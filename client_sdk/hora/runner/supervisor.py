"""The one process supervisor of ``horarun``: it starts workers, watches them, stops them.

:class:`Supervisor` does; a :class:`Planner` decides. Every
:data:`POLL_INTERVAL` seconds the supervisor reaps the workers that exited,
hands them to the planner (:meth:`Planner.step`) and carries out the
actions it answers: start a worker (:class:`Spawn`), stop one
(:class:`StopWorker`), tell the user (:class:`Say`), end the job
(:class:`Finish`). Two planners drive it: :class:`.fixed.FixedPlanner` for
a fixed world, :class:`.elastic_driver.ElasticDriver` for an elastic job.

What the supervisor does by itself is the same for both:

* Each worker runs in its own session (and so its own process group): a
  Ctrl-C in the terminal then reaches only ``horarun``, which forwards it
  exactly once to every worker's group, grandchildren included, and tells
  the planner to decide nothing more. A second one skips the rest of the
  grace period.
* A worker asked to stop gets SIGTERM (or the forwarded signal), and
  SIGKILL if it still runs a grace period later; one that outlives SIGKILL
  by :data:`REAP_TIMEOUT` is given up on.
* :class:`Finish` fixes the exit code; the workers still running get the
  finish's notice period to exit on their own, then are stopped. The job
  ends when no worker is left.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from .output import WorkerOutput

__all__ = [
    "GRACE_PERIOD",
    "POLL_INTERVAL",
    "Action",
    "Exit",
    "Finish",
    "Planner",
    "Say",
    "SignalRecorder",
    "Spawn",
    "StopWorker",
    "Supervisor",
    "describe_exit",
    "exit_code_of",
    "plural",
    "signal_group",
    "signal_name",
]

POLL_INTERVAL = 0.05
GRACE_PERIOD = 5.0
# How long to wait for a process to be reaped after SIGKILL.
REAP_TIMEOUT = 5.0


def exit_code_of(returncode: int) -> int:
    """Maps a Popen return code to a shell exit code (signal N -> 128+N)."""
    return 128 - returncode if returncode < 0 else returncode


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``signal N`` for a number Python has no name for."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int) -> str:
    """Says how a process ended, e.g. ``exited with code 3``."""
    if returncode < 0:
        return f"was killed by {signal_name(-returncode)}"
    return f"exited with code {returncode}"


def plural(count: int, word: str) -> str:
    """``1 worker``, ``2 workers``."""
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def signal_group(pid: int, signum: int) -> None:
    """Sends ``signum`` to the process group led by ``pid``, if it still exists."""
    try:
        # start_new_session made the worker its group's leader, so its pid
        # is the group id; the group outlives the leader while any
        # grandchild remains, which is what we want to reach.
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


# -- what a planner may ask for ------------------------------------------------------


@dataclass(frozen=True)
class Spawn:
    """Start a worker process.

    Attributes:
        worker_id: the planner's name for the worker in later calls and actions.
        host: the machine to run it on.
        argv: the command.
        env: its whole environment.
        label: what prefixes its output lines, inside the brackets; also
            names it in the list of workers killed.
        name: how a message about this worker alone names it
            (``rank 0``, ``worker host:0``).
        output_name: its folder below ``--output-filename``.
        append: append to that folder's files instead of truncating them
            (a replacement worker continuing its slot's log).
    """

    worker_id: int
    host: str
    argv: Sequence[str]
    env: Mapping[str, str]
    label: str
    name: str
    output_name: str
    append: bool = False


@dataclass(frozen=True)
class StopWorker:
    """Stop a worker (``signum``, SIGTERM by default, then SIGKILL after the
    grace period)."""

    worker_id: int
    signum: int = signal.SIGTERM


@dataclass(frozen=True)
class Say:
    """Tell the user (``horarun: MESSAGE`` on stderr)."""

    message: str


@dataclass(frozen=True)
class Finish:
    """Stop every remaining worker and exit with ``code``.

    ``notice`` is how many seconds the workers still running get to exit on
    their own before SIGTERM.
    """

    code: int
    notice: float = 0.0


Action = Spawn | StopWorker | Say | Finish


@dataclass(frozen=True)
class Exit:
    """A worker's process ended with ``returncode`` (Popen's: -N for signal N)."""

    worker_id: int
    pid: int
    returncode: int


class Planner(Protocol):
    """What decides for a :class:`Supervisor`: which workers run, and when the job ends.

    Attributes:
        kill_prefix: what precedes the list of workers in the SIGKILL
            message (horovodrun's habits differ: ``"rank "`` before rank
            numbers, nothing before ``host:slot`` labels).
    """

    kill_prefix: str

    def step(self, exits: Sequence[Exit]) -> Sequence[Action]:
        """What to do now, given the workers that exited since the last call.

        Called every :data:`POLL_INTERVAL` until the job finishes, the first
        time before any worker has started.
        """
        ...

    def started(self, worker_id: int, pid: int) -> Sequence[Action]:
        """The worker of a :class:`Spawn` started as process ``pid``."""
        ...

    def start_failed(self, worker_id: int, code: int, error: str) -> Sequence[Action]:
        """The worker of a :class:`Spawn` could not be started.

        ``code`` is the shell's for it: 127 when the command does not exist,
        else 126.
        """
        ...

    def interrupted(self) -> None:
        """horarun got a signal: the supervisor stops everything; decide nothing more."""
        ...


# -- doing it ------------------------------------------------------------------------


class SignalRecorder:
    """Records SIGINT and SIGTERM for a supervision loop to act on.

    Handlers are installed only from the main thread (Python's rule); from
    any other thread this records nothing and changes nothing.
    """

    def __init__(self) -> None:
        self._pending: list[int] = []
        self._previous: dict[int, object] = {}

    def _on_signal(self, signum: int, frame: object) -> None:
        # Only record: the supervision loop acts on it within POLL_INTERVAL,
        # so no work happens inside the handler.
        self._pending.append(signum)

    def install(self) -> None:
        """Takes over SIGINT and SIGTERM."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def restore(self) -> None:
        """Puts the previous handlers back."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous = {}

    def take(self) -> list[int]:
        """The signals received since the last call, oldest first."""
        taken, self._pending = self._pending, []
        return taken


@dataclass
class _Proc:
    spawn: Spawn
    proc: subprocess.Popen[bytes]
    # When SIGKILL is due (it was asked to stop), math.inf once it was sent.
    kill_at: float | None = None
    killed_at: float | None = None


class Supervisor:
    """Runs workers as a planner says until the job finishes or a signal stops it.

    Args:
        planner: decides which workers run and when the job ends.
        output: starts workers and forwards their output; says messages.
        grace_period: seconds between SIGTERM (or a forwarded signal) and SIGKILL.
    """

    def __init__(self, planner: Planner, output: WorkerOutput, *,
                 grace_period: float = GRACE_PERIOD) -> None:
        self._planner = planner
        self._output = output
        self._grace = grace_period
        self._signals = SignalRecorder()
        self._procs: dict[int, _Proc] = {}
        self._exit_code: int | None = None
        # When every worker still running gets SIGTERM (a Finish's notice).
        self._term_at: float | None = None
        # Every worker was asked to stop (a Finish or a signal).
        self._stopping = False
        self._hurried = False
        self._exited = threading.Event()

    def run(self) -> int:
        """Supervises the job until it ends.

        Returns:
            The exit code of the planner's :class:`Finish`, or 128+N when
            horarun itself got signal N first.
        """
        self._signals.install()
        try:
            while True:
                self._handle_signals()
                exits = self._reap()
                if self._exit_code is None:
                    self._apply(self._planner.step(exits))
                self._enforce_deadlines()
                if self._exit_code is not None and not self._procs:
                    break
                # A worker's exit wakes the loop at once: an elastic job must
                # act on a failure before the survivors re-form the world.
                self._exited.wait(POLL_INTERVAL)
                self._exited.clear()
            self._output.drain()
        finally:
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

    # -- doing what the planner says ---------------------------------------------------

    def _apply(self, actions: Sequence[Action]) -> None:
        for action in actions:
            if isinstance(action, Spawn):
                # Starting many workers takes a while: a Ctrl-C meanwhile
                # stops the starting too.
                self._handle_signals()
                if self._exit_code is None:
                    self._spawn(action)
            elif isinstance(action, StopWorker):
                proc = self._procs.get(action.worker_id)
                if proc is not None:
                    self._terminate(proc, action.signum)
            elif isinstance(action, Say):
                self._output.say(action.message)
            elif isinstance(action, Finish):
                self._finish(action)

    def _spawn(self, action: Spawn) -> None:
        try:
            proc = self._output.spawn(action.label, action.argv, action.env,
                                      action.output_name, host=action.host,
                                      append=action.append)
        except OSError as exc:
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            self._apply(self._planner.start_failed(action.worker_id, code, str(exc)))
            return
        self._procs[action.worker_id] = _Proc(action, proc)
        threading.Thread(target=self._watch, args=(proc,), name=f"horarun-wait-{proc.pid}",
                         daemon=True).start()
        self._apply(self._planner.started(action.worker_id, proc.pid))

    def _watch(self, proc: subprocess.Popen[bytes]) -> None:
        # Popen.wait on this thread; the loop's poll() reads the result.
        proc.wait()
        self._exited.set()

    def _finish(self, action: Finish) -> None:
        if self._exit_code is None:
            self._exit_code = action.code
        if action.notice > 0:
            if self._term_at is None:
                self._term_at = time.monotonic() + action.notice
        else:
            self._stop_all(signal.SIGTERM)

    def _terminate(self, proc: _Proc, signum: int) -> None:
        signal_group(proc.proc.pid, signum)
        if proc.kill_at is None:
            proc.kill_at = time.monotonic() + self._grace

    def _stop_all(self, signum: int) -> None:
        self._stopping = True
        for proc in self._procs.values():
            self._terminate(proc, signum)

    # -- what happened -----------------------------------------------------------------

    def _reap(self) -> list[Exit]:
        exits = []
        for worker_id, proc in list(self._procs.items()):
            returncode = proc.proc.poll()
            if returncode is not None:
                del self._procs[worker_id]
                exits.append(Exit(worker_id, proc.proc.pid, returncode))
        return exits

    def _handle_signals(self) -> None:
        for signum in self._signals.take():
            if not self._stopping:
                self._planner.interrupted()
                if self._exit_code is None:
                    self._exit_code = 128 + signum
                self._output.say(f"received {signal_name(signum)}; forwarding it to "
                                 f"{plural(len(self._procs), 'worker')}")
                self._stop_all(signum)
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
        if self._term_at is not None and not self._stopping and now >= self._term_at:
            self._stop_all(signal.SIGTERM)
        due = [p for p in self._procs.values() if p.kill_at is not None and p.kill_at <= now]
        if due:
            after = "" if self._hurried else f" after {self._grace:g} s"
            names = ", ".join(f"{p.spawn.label} (pid {p.proc.pid})" for p in due)
            self._output.say(f"{plural(len(due), 'worker')} still running{after}; "
                             f"killing {self._planner.kill_prefix}{names}")
            for proc in due:
                signal_group(proc.proc.pid, signal.SIGKILL)
                proc.kill_at = math.inf
                proc.killed_at = now
        for worker_id, proc in list(self._procs.items()):
            if proc.killed_at is not None and now - proc.killed_at > REAP_TIMEOUT:
                self._output.say(f"{proc.spawn.name} (pid {proc.proc.pid}) did not exit "
                                 f"after SIGKILL; giving up on it")
                del self._procs[worker_id]
