"""What the deployment tests share: finding (and starting) the tools, docker compose
projects that clean up after themselves, and the loud line for a skipped part.

A part whose tools are missing skips at module level through :func:`require`;
``tests/deploy/conftest.py`` then prints one loud line per skipped part at the
end of the run, so that a ``make test`` without Docker or kubectl says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

__all__ = ["RESULTS", "ROOT", "SKIPPED", "TIMINGS", "ComposeProject", "docker_missing", "require", "run"]

ROOT = Path(__file__).resolve().parents[2]
#: Part -> why it was skipped (printed loudly at the end of the run).
SKIPPED: dict[str, str] = {}
#: Step -> seconds it took (printed at the end of the run).
TIMINGS: dict[str, float] = {}
#: What a run reached, e.g. "2 trainers" -> "Accuracy: 0.9861" (printed at the end of the run).
RESULTS: dict[str, str] = {}
DOCKERD_LOG = Path("/var/log/hora-test-dockerd.log")


def require(part: str, missing: Sequence[str]) -> None:
    """Skips the calling test module, loudly, when anything it needs is missing."""
    if not missing:
        return
    reason = (f"DEPLOYMENT TESTS SKIPPED ({part}): missing {'; '.join(missing)}. "
              f"`make deploy-deps` installs them (as root)")
    SKIPPED[part] = reason
    pytest.skip(reason, allow_module_level=True)


def run(args: Sequence[str], timeout: float, check: bool = True,
        env: Mapping[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Runs a command to completion within ``timeout`` seconds, output captured.

    Raises:
        AssertionError: it failed (``check``) or ran out of time, with its output.
    """
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                              env=dict(env) if env is not None else None, cwd=cwd)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{' '.join(args)} did not finish in {timeout} s\n"
                             f"{_text(exc.stdout)[-3000:]}\n{_text(exc.stderr)[-3000:]}") from None
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited with {proc.returncode}\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _answers(args: Sequence[str], timeout: float = 20) -> bool:
    try:
        return subprocess.run(list(args), capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _start_dockerd() -> str:
    """Starts dockerd in the background (root only); '' once it answers, else why not."""
    if shutil.which("dockerd") is None:
        return "dockerd (Debian package docker.io)"
    if os.geteuid() != 0:
        return "a running Docker daemon (dockerd is installed, but only root may start it)"
    log = open(DOCKERD_LOG, "ab")  # noqa: SIM115 (the daemon keeps it)
    subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                     start_new_session=True)
    log.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if _answers(["docker", "info"], timeout=10):
            return ""
        time.sleep(0.5)
    return f"a running Docker daemon (dockerd did not answer within 60 s; see {DOCKERD_LOG})"


def docker_missing(base_image: str) -> list[str]:
    """What the image and compose tests lack; starts dockerd when it is installed but down."""
    if shutil.which("docker") is None:
        return ["the docker CLI (Debian package docker.io)"]
    missing = []
    if not _answers(["docker", "info"]):
        why = _start_dockerd()
        if why:
            missing.append(why)
    if not _answers(["docker", "compose", "version"]):
        missing.append("the Docker Compose v2 plugin (`docker compose`)")
    if shutil.which("debootstrap") is None:
        # Not needed while the base image made earlier is there.
        if missing or not _answers(["docker", "image", "inspect", base_image]):
            missing.append(f"debootstrap (to make the base image {base_image})")
    return missing


def checkout_tag(prefix: str) -> str:
    """``prefix`` and a hash of this checkout's path: checkouts on one machine (and
    the engineers working in them) do not overwrite each other's images."""
    return f"{prefix}-{hashlib.sha256(str(ROOT).encode()).hexdigest()[:8]}"


class ComposeProject:
    """``docker compose -p NAME -f FILES --env-file ENV`` for one test; :meth:`down` removes
    everything it made (containers, network, volumes) and says what is left.

    Args:
        name: The project name (unique per test run).
        files: Compose files, relative to the repository root.
        env_file: Where the settings are written, as a user's ``.env`` would hold them.
        settings: The settings (HORA_TOKEN, HORA_IMAGE, ...).
        root: Where the files are (and the build context): a checkout.
    """

    def __init__(self, name: str, files: Sequence[str], env_file: Path,
                 settings: Mapping[str, str], root: Path = ROOT) -> None:
        self.name = name
        self.root = root
        self.files = list(files)
        self.env_file = env_file
        self.settings = dict(settings)
        env_file.write_text("".join(f"{k}={v}\n" for k, v in self.settings.items()))
        # Compose reads variables from the process too, and they win over the env
        # file: none of the caller's HORA_* or COMPOSE_* may leak in.
        self._env = {k: v for k, v in os.environ.items()
                     if not k.startswith(("HORA_", "HOROVOD_", "COMPOSE_"))}

    def compose(self, *args: str, timeout: float = 120, check: bool = True
                ) -> subprocess.CompletedProcess:
        files = [a for f in self.files for a in ("-f", str(self.root / f))]
        return run(["docker", "compose", "-p", self.name, *files, "--env-file",
                    str(self.env_file), *args], timeout=timeout, check=check, env=self._env)

    def containers(self, service: str) -> list[dict]:
        """The service's containers, running or not: Name, State, ExitCode, ..."""
        out = self.compose("ps", "--all", "--format", "json", service).stdout
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
        # Compose before 2.21 printed one JSON array, later one object per line.
        return [r for row in rows for r in (row if isinstance(row, list) else [row])]

    def logs(self, container: str) -> str:
        """The container's output, stdout and stderr interleaved as it wrote them."""
        proc = subprocess.run(["docker", "logs", container], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=30, check=True)
        return proc.stdout

    def published(self, service: str, port: int) -> str:
        """``HOST:PORT`` on this machine where the service's ``port`` is published."""
        return self.compose("port", service, str(port)).stdout.strip()

    def wait_exited(self, service: str, count: int, timeout: float) -> list[dict]:
        """Waits until ``count`` containers of ``service`` have exited; their rows."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.containers(service)
            done = [r for r in rows if r["State"] == "exited"]
            if len(done) >= count:
                return done
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{len(done)} of {count} {service} container(s) exited within {timeout} s: "
                    f"{[(r['Name'], r['State']) for r in rows]}\n{self.all_logs()[-6000:]}")
            time.sleep(1)

    def wait_for_line(self, service: str, needle: str, timeout: float) -> str:
        """Waits until a container of ``service`` logs a line containing ``needle``;
        that container's name."""
        deadline = time.monotonic() + timeout
        while True:
            for row in self.containers(service):
                if needle in self.logs(row["Name"]):
                    return row["Name"]
            if time.monotonic() > deadline:
                raise AssertionError(f"no {service} container logged {needle!r} within "
                                     f"{timeout} s\n{self.all_logs()[-6000:]}")
            time.sleep(0.5)

    def all_logs(self) -> str:
        return self.compose("logs", "--no-color", timeout=60, check=False).stdout

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes of this project that still exist."""
        label = f"label=com.docker.compose.project={self.name}"
        found = {}
        for kind, args in (("containers", ["ps", "--all"]), ("networks", ["network", "ls"]),
                           ("volumes", ["volume", "ls"])):
            out = run(["docker", *args, "--quiet", "--filter", label], timeout=30).stdout
            found[kind] = out.split()
        return found

    def down(self) -> dict[str, list[str]]:
        """Stops and removes everything of the project; what is left (should be nothing)."""
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "5", timeout=180)
        return self.leftovers()
