"""Where an elastic job's hosts come from: a discovery script, or a fixed list.

A discovery script is a shell command (run by ``/bin/sh``, as horovodrun
does, so it may carry arguments) that prints the hosts available now, one
``host`` or ``host:slots`` per line. :class:`HostPoller` runs it every
:data:`DISCOVERY_INTERVAL` seconds on a thread of its own, so a slow script
never delays supervision, and keeps the last good answer: a script that
fails, times out or prints a bad line leaves the host list as it was.
"""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Callable, Sequence

from .hosts import HostError, HostSlots, parse_discovery_output
from .supervisor import describe_exit, signal_group

__all__ = [
    "DISCOVERY_INTERVAL",
    "DISCOVERY_TIMEOUT",
    "DiscoveryError",
    "HostPoller",
    "run_discovery_script",
]

DISCOVERY_INTERVAL = 1.0
DISCOVERY_TIMEOUT = 10.0
# Characters of a failing script's stderr quoted in the message.
_STDERR_TAIL = 200

# Scripts running now, so that stopping the poller can end them: the thread
# that waits on one is a daemon, and dies with horarun without killing it.
_running: set[subprocess.Popen[bytes]] = set()
_running_lock = threading.Lock()


class DiscoveryError(Exception):
    """The discovery script failed, timed out, or printed a line that is not
    ``host[:slots]``. The message is meant for the user as is."""


def run_discovery_script(script: str, default_slots: int = 1,
                         timeout: float = DISCOVERY_TIMEOUT) -> list[HostSlots]:
    """Runs ``script`` once and parses what it printed.

    Args:
        script: the shell command.
        default_slots: slots of a host printed without ``:slots``.
        timeout: seconds the script may take; then its process group is killed.

    Returns:
        The hosts in the order printed (possibly none).

    Raises:
        DiscoveryError: the script could not start, exited non-zero, timed
            out, or printed a bad line.
    """
    try:
        proc = subprocess.Popen(script, shell=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, close_fds=True)
    except OSError as exc:
        raise DiscoveryError(f"cannot run {script!r}: {exc}") from exc
    with _running_lock:
        _running.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        signal_group(proc.pid, signal.SIGKILL)
        try:
            proc.communicate(timeout=1.0)
        except subprocess.TimeoutExpired:
            # A grandchild outside the group still holds the pipes; the
            # script itself is dead, which is all that matters here.
            proc.kill()
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass  # unkillable (uninterruptible sleep): leave it
        finally:
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        raise DiscoveryError(f"{script!r} did not finish within {timeout:g} s") from None
    finally:
        with _running_lock:
            _running.discard(proc)
    if proc.returncode != 0:
        tail = err.decode("utf-8", errors="replace").strip()[-_STDERR_TAIL:]
        detail = f": {tail}" if tail else ""
        raise DiscoveryError(f"{script!r} {describe_exit(proc.returncode)}{detail}")
    try:
        return parse_discovery_output(out.decode("utf-8", errors="replace"), default_slots,
                                      name=f"{script!r} output")
    except HostError as exc:
        raise DiscoveryError(str(exc)) from exc


class HostPoller:
    """Calls ``find`` now and then every ``interval`` seconds, on a daemon thread.

    Args:
        find: returns the hosts available now; raises :class:`DiscoveryError`
            when it cannot tell.
        interval: seconds between the end of one call and the next.
        say: prints a launcher message; called from the poller's thread.
    """

    def __init__(self, find: Callable[[], Sequence[HostSlots]], *,
                 interval: float = DISCOVERY_INTERVAL,
                 say: Callable[[str], None] = lambda message: None) -> None:
        self._find = find
        self._interval = interval
        self._say = say
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._latest: tuple[int, list[HostSlots]] | None = None
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="horarun-discovery",
                                        daemon=True)

    def start(self) -> None:
        """Starts polling."""
        self._thread.start()

    def stop(self) -> None:
        """Stops polling; a discovery script still running is killed, not waited for."""
        self._stop.set()
        with _running_lock:
            scripts = list(_running)
        for proc in scripts:
            signal_group(proc.pid, signal.SIGKILL)

    def latest(self) -> tuple[int, list[HostSlots]] | None:
        """``(version, hosts)`` of the last good answer, None before the first.

        The version grows with every good answer, changed or not.
        """
        with self._lock:
            return self._latest

    def poll_once(self) -> None:
        """Calls ``find`` once and records the answer (what the thread repeats)."""
        try:
            hosts = list(self._find())
        except DiscoveryError as exc:
            if not self._failing:
                self._failing = True
                self._say(f"host discovery failed: {exc}; keeping the previous host list "
                          f"(not repeated until discovery works again)")
            return
        if self._failing:
            self._failing = False
            self._say("host discovery works again")
        with self._lock:
            version = self._latest[0] + 1 if self._latest is not None else 1
            self._latest = (version, hosts)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self._interval)
