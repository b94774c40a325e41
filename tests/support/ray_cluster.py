"""A real Ray cluster of the test's own: each node a "machine" (network namespace).

:class:`RayCluster` reuses :class:`ssh_hosts.SshHosts`' network (namespaces
``h1``.. on a bridge, each with its own address) without its sshd, and runs
``ray start`` inside them::

    h1 (10.77.0.11): ray start --head (GCS, raylet), and the test's driver script
    h2 (10.77.0.12): ray start --address 10.77.0.11:6379
    h3 (10.77.0.13): a spare, for a node that joins during a run

Each node has its own Ray temp folder below the test's directory and small
resources (``--num-cpus``). :meth:`RayCluster.close` stops every process in
the namespaces (the raylets, GCS, actors and the driver) and deletes them.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ssh_hosts import Host, SshHosts, SshHostsUnavailable

__all__ = ["RayCluster", "RayUnavailable", "ray_missing"]

GCS_PORT = 6379
_START_TIMEOUT = 90.0


class RayUnavailable(RuntimeError):
    """This machine cannot run the cluster (no Ray, not root, no ``ip``)."""


def ray_missing() -> list[str]:
    """What this machine lacks for :class:`RayCluster`; empty when nothing."""
    missing = []
    if shutil.which("ray", path=str(Path(sys.executable).parent)) is None:
        missing.append("ray (pip install 'hora[ray]')")
    if os.geteuid() != 0:
        missing.append("root (network namespaces)")
    if shutil.which("ip") is None:
        missing.append("iproute2 (the 'ip' tool)")
    return missing


class _Network(SshHosts):
    """SshHosts' namespaces and bridge, without keys or sshd."""

    def start(self) -> _Network:
        try:
            self._network()
        except BaseException:
            self.close()
            raise
        return self


class RayCluster:
    """``count`` namespace hosts; :meth:`start_head` and :meth:`add_node` run Ray on them.

    Args:
        workdir: the test's directory (Ray's temp folders, logs).
        env: the environment of every Ray process (PYTHONPATH for hora).
        count: hosts to make (h1 is the head).
    """

    def __init__(self, workdir: Path, env: Mapping[str, str], count: int = 3) -> None:
        self.workdir = workdir
        # Token authentication with a token of the test's own: ~/.ray is neither read nor
        # written, and nothing outside the test can join its cluster.
        self.env = {**env, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1",
                    # Every worker line reaches the driver's output as it is.
                    "RAY_DEDUP_LOGS": "0", "RAY_COLOR_PREFIX": "0",
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self.ray = str(Path(sys.executable).parent / "ray")
        self.net = _Network(workdir, count=count)
        self.head = self.net.hosts[0]
        self.address = f"{self.head.address}:{GCS_PORT}"

    def __enter__(self) -> RayCluster:
        try:
            self.net.start()
        except SshHostsUnavailable as exc:
            raise RayUnavailable(str(exc)) from exc
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def host(self, name: str) -> Host:
        return self.net.host(name)

    def _ray_start(self, host: Host, extra: Sequence[str], num_cpus: int) -> None:
        temp = self.workdir / f"ray-{host.name}"
        temp.mkdir(exist_ok=True)
        argv = [*host.prefix, self.ray, "start", *extra, f"--node-ip-address={host.address}",
                f"--num-cpus={num_cpus}", "--num-gpus=0", f"--temp-dir={temp}",
                "--object-store-memory=100000000", "--disable-usage-stats"]
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True,
                              timeout=_START_TIMEOUT, stdin=subprocess.DEVNULL, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"ray start on {host.name} failed ({done.returncode}):\n"
                               f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")

    def start_head(self, num_cpus: int = 1) -> None:
        """``ray start --head`` on h1 (GCS on port 6379 of its own address)."""
        self._ray_start(self.head, ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"],
                        num_cpus)

    def add_node(self, name: str, num_cpus: int = 1) -> None:
        """``ray start --address HEAD`` on host ``name``."""
        self._ray_start(self.host(name), [f"--address={self.address}"], num_cpus)

    def raylet_pids(self, name: str) -> list[int]:
        """The raylet processes of host ``name``."""
        found = []
        for pid in self.net.pids(self.host(name)):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if command.endswith(b"/raylet"):
                found.append(pid)
        return found

    def kill_node(self, name: str) -> None:
        """SIGKILLs everything on host ``name``: its raylet, its workers, as a node that dies."""
        for pid in self.net.pids(self.host(name)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def driver(self, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None
               ) -> subprocess.Popen[bytes]:
        """Starts ``argv`` (a driver script) on the head's host, output to ``log``."""
        with open(log, "wb") as out:
            return subprocess.Popen([*self.head.prefix, *argv], env={**self.env, **(env or {})},
                                    stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT)

    def wait_nodes(self, count: int, timeout: float = 60.0) -> None:
        """Waits until ``ray status`` on the head lists ``count`` alive nodes."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            done = subprocess.run([*self.head.prefix, self.ray, "status",
                                   f"--address={self.address}"], env=self.env,
                                  capture_output=True, text=True, timeout=30, check=False)
            last = done.stdout
            if last.count("node_") >= count:
                return
            time.sleep(1.0)
        raise RuntimeError(f"the Ray cluster has not {count} nodes after {timeout:g} s:\n{last}")

    def logs(self) -> str:
        """The tail of every node's raylet log."""
        lines = []
        for path in sorted(self.workdir.glob("ray-*/session_latest/logs/raylet.out")):
            tail = path.read_text(errors="replace").splitlines()[-15:]
            lines.append(f"--- {path}\n" + "\n".join(tail))
        return "\n".join(lines)

    def close(self) -> None:
        """Kills every process in the namespaces and deletes them (idempotent)."""
        self.net.close()


