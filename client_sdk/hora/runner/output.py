"""Starting worker processes and forwarding their output, line by line.

:class:`WorkerOutput` starts a worker in a session of its own (on this
machine, or over ssh as :mod:`.remote` describes) and gives each of its
pipes a reader thread that forwards whole lines, prefixed by the worker's
label (``[0]<stdout>:``), to the launcher's own stdout and stderr, and
with ``--output-filename`` also to ``DIR/NAME/stdout|stderr``. It keeps
the last lines of each worker's stderr to quote when the worker fails.
What happens to the processes after they start is the business of
:mod:`.supervisor`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, TextIO, cast

from .hosts import is_local_host
from .remote import RemoteShell

__all__ = ["WorkerOutput"]

# How long to wait for the output readers to drain after the workers are
# gone. An orphaned grandchild that keeps a pipe open must not keep horarun
# alive.
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
