"""A real ``hora-coordinator`` process for tests.

with CoordinatorProcess(extra_args=["--lease-s", "2"]) as coord:
    channel = grpc.insecure_channel(coord.grpc_address)
    stub.Join(request, metadata=coord.metadata, timeout=5)
    httpx.get(coord.http_url + "/healthz")
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["CoordinatorProcess"]


class CoordinatorProcess:
    """Spawns ``python -m hora_coordinator`` on free ports and waits until it serves.

    Args:
        extra_args: More flags, e.g. ``["--lease-s", "1"]``.
        token: Job token; a random one when None; "" passes no ``--token`` (nor
            ``HORA_TOKEN``), so the coordinator makes one up (read from its ready file).
        env: Extra environment variables for the process.
        startup_timeout: Seconds to wait for the ready file.
        host: Address to bind.
        command_prefix: Run the coordinator under this command, e.g.
            ``["ip", "netns", "exec", NAME]`` (it must exec the coordinator, so
            that signals reach it).

    Attributes:
        token: The job token.
        grpc_port, http_port, pid: Filled in by :meth:`start`.
    """

    def __init__(
        self,
        extra_args: Sequence[str] = (),
        *,
        token: str | None = None,
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 20.0,
        host: str = "127.0.0.1",
        command_prefix: Sequence[str] = (),
    ) -> None:
        self.extra_args = list(extra_args)
        self.command_prefix = list(command_prefix)
        self.token = token if token is not None else secrets.token_hex(16)
        self.host = host
        self.startup_timeout = startup_timeout
        self._env = dict(env or {})
        self._dir = Path(tempfile.mkdtemp(prefix="hora-coordinator-"))
        self.ready_file = self._dir / "ready.json"
        self.log_file = self._dir / "coordinator.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.grpc_port = 0
        self.http_port = 0
        self.pid = 0

    @property
    def grpc_address(self) -> str:
        """``HOST:PORT`` for gRPC channels."""
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        """``http://HOST:PORT`` of the HTTP API."""
        return f"http://{self.host}:{self.http_port}"

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC call metadata that carries the token."""
        return (("hora-token", self.token),)

    def start(self) -> CoordinatorProcess:
        """Starts the process and blocks until its ready file appears.

        Raises:
            RuntimeError: it exited or did not get ready in time; the message
                carries its log.
        """
        cmd = [
            *self.command_prefix,
            sys.executable,
            "-m",
            "hora_coordinator",
            "--host",
            self.host,
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--ready-file",
            str(self.ready_file),
            *(["--token", self.token] if self.token else []),
            *self.extra_args,
        ]
        inherited = {k: v for k, v in os.environ.items() if self.token or k != "HORA_TOKEN"}
        env = {**inherited, "PYTHONUNBUFFERED": "1", **self._env}
        with open(self.log_file, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"coordinator exited with {self.proc.returncode} before "
                    f"it was ready; log:\n{self.log()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"coordinator not ready within {self.startup_timeout} s; log:\n{self.log()}"
                )
            time.sleep(0.02)
        ready = json.loads(self.ready_file.read_text())
        self.grpc_port, self.http_port, self.pid = (
            ready["grpc_port"],
            ready["http_port"],
            ready["pid"],
        )
        self.token = ready["token"]
        return self

    def log(self) -> str:
        """Everything the process wrote so far."""
        try:
            return self.log_file.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def running(self) -> bool:
        """Whether the process is still alive."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        return self.proc.returncode

    def dump_log(self, file=None) -> None:
        """Writes the log to ``file`` (default stderr), framed, for failure reports."""
        out = file or sys.stderr
        print(f"----- hora-coordinator log ({self.log_file}) -----", file=out)
        print(self.log(), file=out)
        print("----- end of hora-coordinator log -----", file=out)

    def __enter__(self) -> CoordinatorProcess:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop()
        if exc_type is not None:
            self.dump_log()
