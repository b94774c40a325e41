"""Worker processes: start them, forward their output, supervise them.

Each worker runs in its own session (and so its own process group): a
Ctrl-C in the terminal then reaches only ``horarun``, which forwards it
exactly once to every worker's group, grandchildren included.

Supervision polls every :data:`POLL_INTERVAL` seconds so that a death is
noticed within about 100 ms. The first worker to fail decides the exit
code. The others get :data:`NOTICE_PERIOD` to fail on their own (a survivor
of a lost rank raises RankLostError naming it), then SIGTERM, then SIGKILL
after a grace period.

The pieces that do not depend on a fixed world (:class:`WorkerOutput`,
which starts a process and forwards its output, :class:`SignalRecorder`
and :func:`signal_group`) are shared with the elastic supervisor in
:mod:`.elastic_supervisor`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TextIO, cast

from .hosts import is_local_host
from .remote import RemoteShell

__all__ = [
    "GRACE_PERIOD",
    "POLL_INTERVAL",
    "SignalRecorder",
    "Supervisor",
    "WorkerOutput",
    "WorkerSpec",
    "describe_exit",
    "exit_code_of",
    "plural",
    "signal_group",
    "signal_name",
]

POLL_INTERVAL = 0.05
GRACE_PERIOD = 5.0
# After a worker fails, how long the others may take to fail on their own
# before SIGTERM: long enough for a survivor to report the RankLostError that
# names the lost rank, which is what the user needs to read.
NOTICE_PERIOD = 1.0
# How long to wait for processes to be reaped after SIGKILL, and for the
# output readers to drain after the workers are gone. An orphaned grandchild
# that keeps a pipe open must not keep horarun alive.
REAP_TIMEOUT = 5.0
DRAIN_TIMEOUT = 5.0
# Longest chunk forwarded as one line; bounds memory for output without
# newlines (progress bars).
MAX_LINE = 1 << 16
# Lines of a worker's stderr kept to quote when it fails, and the most
# characters of the one quoted.
TAIL_LINES = 20
QUOTE_CHARS = 300
# How long to wait for a dead worker's last stderr lines to be read.
TAIL_TIMEOUT = 0.5


@dataclass(frozen=True)
class WorkerSpec:
    """One worker to start: its rank, host, command and environment."""

    rank: int
    hostname: str
    argv: Sequence[str]
    env: Mapping[str, str]


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


class _Sink:
    """A text stream shared by many reader threads; writes whole lines only."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self._broken = False

    def write(self, text: str) -> None:
        with self._lock:
            if self._broken:
                return
            try:
                buffer = getattr(self._stream, "buffer", None)
                if buffer is not None:
                    encoding = getattr(self._stream, "encoding", None) or "utf-8"
                    buffer.write(text.encode(encoding, errors="replace"))
                    buffer.flush()
                else:
                    self._stream.write(text)
                    self._stream.flush()
            except (OSError, ValueError):
                # A closed terminal or a reader that went away (`| head`):
                # keep draining the workers' pipes so they never block.
                self._broken = True


class _Reader(threading.Thread):
    """Forwards one pipe of one worker, line by line, with the worker's label."""

    def __init__(self, label: str, stream_name: str, pipe: BinaryIO, sink: _Sink,
                 prefix: bool, copy_to: Path | None, append: bool,
                 timestamp: bool = False) -> None:
        super().__init__(name=f"horarun-{stream_name}-{label}", daemon=True)
        self._pipe = pipe
        self._sink = sink
        self._prefix = f"[{label}]<{stream_name}>:" if prefix else ""
        self._timestamp = timestamp
        # The last lines read, to quote when the worker fails.
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._copy_to = copy_to
        self._mode = "a" if append else "w"

    def run(self) -> None:
        copy = (self._copy_to.open(self._mode, encoding="utf-8")
                if self._copy_to else None)
        try:
            while True:
                raw = self._pipe.readline(MAX_LINE)
                if not raw:
                    break
                text = raw.decode("utf-8", errors="replace")
                if not text.endswith("\n"):
                    # A partial last line, or a chunk of an overlong one.
                    text += "\n"
                self.tail.append(text)
                stamp = ""
                if self._timestamp:
                    # horovodrun's --prefix-output-with-timestamp layout.
                    stamp = time.strftime("%a %b %d %H:%M:%S %Y")
                    stamp += "" if self._prefix else " "
                self._sink.write(stamp + self._prefix + text)
                if copy is not None:
                    copy.write(text)
                    copy.flush()
        finally:
            if copy is not None:
                copy.close()
            self._pipe.close()


def _feed(pipe: BinaryIO, data: bytes) -> None:
    """Writes ``data`` and leaves ``pipe`` open; a worker already gone is not an error."""
    try:
        pipe.write(data)
        pipe.flush()
    except (OSError, ValueError):
        pass


def signal_group(pid: int, signum: int) -> None:
    """Sends ``signum`` to the process group led by ``pid``, if it still exists."""
    try:
        # start_new_session made the worker its group's leader, so its pid
        # is the group id; the group outlives the leader while any
        # grandchild remains, which is what we want to reach.
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class WorkerOutput:
    """Starts worker processes and forwards their output, prefixed by a label.

    Args:
        prefix: prefix output lines with ``[LABEL]<stdout>:`` / ``[LABEL]<stderr>:``.
        output_dir: also write each worker's output to ``DIR/NAME/stdout|stderr``.
        stdout: where worker stdout goes (default ``sys.stdout``).
        stderr: where worker stderr and launcher messages go (default ``sys.stderr``).
        remote: how to start workers on other machines (None: this machine only).
        timestamp: start every forwarded line with the local time.
    """

    def __init__(self, *, prefix: bool = True, output_dir: str | None = None,
                 stdout: TextIO | None = None, stderr: TextIO | None = None,
                 remote: RemoteShell | None = None, timestamp: bool = False) -> None:
        self._prefix = prefix
        self._timestamp = timestamp
        self._remote = remote
        self._output_dir = Path(output_dir) if output_dir else None
        self._out = _Sink(stdout or sys.stdout)
        self._err = _Sink(stderr or sys.stderr)
        self._readers: list[_Reader] = []
        self._stderr_of: dict[int, _Reader] = {}

    def say(self, message: str) -> None:
        """Prints a launcher message (``horarun: ...``) on the error stream."""
        self._err.write(f"horarun: {message}\n")

    def can_start_on(self, host: str) -> bool:
        """Whether workers can be started on ``host``: this machine, or any over ssh."""
        return self._remote is not None or is_local_host(host)

    def spawn(self, label: str, argv: Sequence[str], env: Mapping[str, str],
              output_name: str, *, host: str = "localhost",
              append: bool = False) -> subprocess.Popen[bytes]:
        """Starts one worker in its own session and forwards its output.

        A worker on another machine is an ``ssh`` process (see
        :mod:`.remote`) whose stdin stays open while it runs: closing it
        stops the remote worker.

        Args:
            label: what prefixes the worker's lines, inside the brackets.
            argv: the command.
            env: its whole environment.
            output_name: its folder below ``output_dir``.
            host: the machine to run it on.
            append: append to that folder's files instead of truncating them
                (a replacement worker continuing its slot's log).

        Raises:
            OSError: the command cannot be started (FileNotFoundError when it
                does not exist) or the output folder cannot be made.
        """
        copies: dict[str, Path | None] = {"stdout": None, "stderr": None}
        if self._output_dir is not None:
            folder = self._output_dir / output_name
            folder.mkdir(parents=True, exist_ok=True)
            copies = {name: folder / name for name in copies}
        stdin: int = subprocess.DEVNULL
        first_input = b""
        if not is_local_host(host):
            if self._remote is None:
                raise OSError(f"{host} is not this machine and remote starts are off")
            argv = self._remote.worker_argv(host, argv, os.getcwd())
            first_input = self._remote.environment_line(env)
            env, stdin = os.environ, subprocess.PIPE
        proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
        )
        # Both are pipes (PIPE above); the casts only inform the type checker.
        pipes = (("stdout", cast(BinaryIO, proc.stdout), self._out),
                 ("stderr", cast(BinaryIO, proc.stderr), self._err))
        for name, pipe, sink in pipes:
            reader = _Reader(label, name, pipe, sink, self._prefix, copies[name], append,
                             self._timestamp)
            reader.start()
            self._readers.append(reader)
            if name == "stderr":
                self._stderr_of[proc.pid] = reader
        if first_input:
            # From a thread: ssh reads it only once connected. The pipe then
            # stays open for as long as the Popen object lives.
            threading.Thread(target=_feed, args=(cast(BinaryIO, proc.stdin), first_input),
                             name=f"horarun-stdin-{label}", daemon=True).start()
        return proc

    def last_error(self, pid: int) -> str:
        """The last non-blank line a worker that has exited wrote to stderr.

        For a Python worker that died of an exception this is the exception
        line (``ValueError: ...``). Waits up to :data:`TAIL_TIMEOUT` for the
        line to be read; forgets the worker. Empty when it wrote nothing.
        """
        reader = self._stderr_of.pop(pid, None)
        if reader is None:
            return ""
        reader.join(TAIL_TIMEOUT)
        for line in reversed(list(reader.tail)):
            if line.strip():
                text = line.strip()
                return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "..."
        return ""

    def drain(self) -> None:
        """Waits (bounded) until the output of every exited worker is forwarded."""
        deadline = time.monotonic() + DRAIN_TIMEOUT
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        # Whatever a surviving grandchild still holds open is not ours to wait
        # for; the readers are daemon threads and die with us.


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
class _Worker:
    spec: WorkerSpec
    proc: subprocess.Popen[bytes]
    returncode: int | None = None


class Supervisor:
    """Starts the workers and waits for them, stopping all when one fails.

    Args:
        specs: the workers to start, in rank order.
        prefix: prefix output lines with ``[RANK]<stdout>:`` / ``[RANK]<stderr>:``.
        output_dir: also write each rank's output to ``DIR/rank.N/stdout|stderr``.
        grace_period: seconds between SIGTERM (or a forwarded signal) and SIGKILL.
        stdout: where prefixed worker stdout goes (default ``sys.stdout``).
        stderr: where prefixed worker stderr and launcher messages go
            (default ``sys.stderr``).
        remote: how to start workers on other machines (None: this machine only).
        timestamp: start every forwarded line with the local time.
    """

    def __init__(self, specs: Sequence[WorkerSpec], *, prefix: bool = True,
                 output_dir: str | None = None, grace_period: float = GRACE_PERIOD,
                 stdout: TextIO | None = None, stderr: TextIO | None = None,
                 remote: RemoteShell | None = None, timestamp: bool = False) -> None:
        self._specs = list(specs)
        self._grace = grace_period
        self._output = WorkerOutput(prefix=prefix, output_dir=output_dir,
                                    stdout=stdout, stderr=stderr, remote=remote,
                                    timestamp=timestamp)
        self._signals = SignalRecorder()
        self._workers: list[_Worker] = []
        self._exit_code: int | None = None
        self._kill_at: float | None = None
        self._term_at: float | None = None
        self._hurried = False

    def _say(self, message: str) -> None:
        self._output.say(message)

    # -- processes -----------------------------------------------------------

    def _running(self) -> list[_Worker]:
        return [w for w in self._workers if w.returncode is None]

    def _stop(self, signum: int) -> None:
        """Sends ``signum`` to every running worker and arms the SIGKILL deadline."""
        for worker in self._running():
            signal_group(worker.proc.pid, signum)
        if self._kill_at is None:
            self._kill_at = time.monotonic() + self._grace

    def _kill_remaining(self) -> None:
        running = self._running()
        if running:
            ranks = ", ".join(f"{w.spec.rank} (pid {w.proc.pid})" for w in running)
            after = "" if self._hurried else f" after {self._grace:g} s"
            self._say(f"{plural(len(running), 'worker')} still running{after}; "
                      f"killing rank {ranks}")
        for worker in running:
            signal_group(worker.proc.pid, signal.SIGKILL)

    def _start(self, spec: WorkerSpec) -> bool:
        try:
            proc = self._output.spawn(str(spec.rank), spec.argv, spec.env, f"rank.{spec.rank}",
                                      host=spec.hostname)
        except OSError as exc:
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            self._fail(code, f"cannot start rank {spec.rank} on {spec.hostname}: {exc}")
            return False
        self._workers.append(_Worker(spec, proc))
        return True

    def _fail(self, code: int, what: str) -> None:
        """Records the first failure, says so, and stops everyone else."""
        if self._exit_code is not None or self._kill_at is not None:
            # Already stopping: deaths from here on are our doing, or too late
            # to change the outcome.
            return
        self._exit_code = code
        others = self._running()
        if others:
            self._say(f"{what}; stopping the other {plural(len(others), 'worker')}")
        else:
            self._say(what)
        self._term_at = time.monotonic() + NOTICE_PERIOD

    def _handle_signals(self) -> None:
        for signum in self._signals.take():
            if self._kill_at is None:
                if self._exit_code is None:
                    self._exit_code = 128 + signum
                running = self._running()
                self._say(f"received {signal_name(signum)}; forwarding it to "
                          f"{plural(len(running), 'worker')}")
                self._stop(signum)
            else:
                # A second Ctrl-C means "now": skip the rest of the grace period.
                self._say(f"received {signal_name(signum)} again; not waiting any longer")
                self._hurried = True
                self._kill_at = time.monotonic()

    def _poll(self) -> None:
        for worker in self._running():
            returncode = worker.proc.poll()
            if returncode is None:
                continue
            worker.returncode = returncode
            if returncode != 0:
                self._fail(
                    exit_code_of(returncode),
                    f"rank {worker.spec.rank} (pid {worker.proc.pid}, host "
                    f"{worker.spec.hostname}) {describe_exit(returncode)}",
                )

    def _reap(self) -> None:
        """Waits (bounded) for killed workers so none is left a zombie."""
        deadline = time.monotonic() + REAP_TIMEOUT
        for worker in self._running():
            try:
                worker.returncode = worker.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._say(f"rank {worker.spec.rank} (pid {worker.proc.pid}) did not exit "
                          f"after SIGKILL; giving up on it")

    def run(self) -> int:
        """Starts all workers and supervises them until they are gone.

        Returns:
            0 when every worker exited 0; else the first failure's exit code
            (128+N for a death by signal N, 127 when the command was not
            found), or 128+N when horarun itself got signal N.
        """
        self._signals.install()
        try:
            for spec in self._specs:
                self._handle_signals()
                if self._exit_code is not None or not self._start(spec):
                    break
            while self._running():
                self._handle_signals()
                self._poll()
                if (self._term_at is not None and self._kill_at is None
                        and time.monotonic() >= self._term_at):
                    self._stop(signal.SIGTERM)
                if self._kill_at is not None and time.monotonic() >= self._kill_at:
                    self._kill_remaining()
                    self._reap()
                    break
                time.sleep(POLL_INTERVAL)
            self._output.drain()
        finally:
            # Never leave workers behind, whatever went wrong above.
            for worker in self._running():
                signal_group(worker.proc.pid, signal.SIGKILL)
            self._reap()
            self._signals.restore()
        return self._exit_code if self._exit_code is not None else 0
