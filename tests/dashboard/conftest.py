"""Fixtures of the dashboard tests: a real browser, and a real elastic job to look at.

The browser is Debian's ``chromium`` driven by Playwright for Python (the
binary at ``$HORA_CHROMIUM``, else ``chromium`` on ``PATH``); Playwright
never downloads one. ``make test`` installs both; without either, the
browser tests are skipped with one line that says which is missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.coordinator import CoordinatorProcess

ROOT = Path(__file__).resolve().parents[2]
JOB_SCRIPT = Path(__file__).with_name("dashboard_job.py")
HORARUN = [sys.executable, "-m", "hora.runner.launch"]
# Loopback aliases as hosts: horarun starts their workers on this machine.
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
SLOW_HOST = HOSTS[2]
NAP_S = 0.08


def chromium_path() -> str | None:
    """Debian's chromium, or the one ``$HORA_CHROMIUM`` names."""
    named = os.environ.get("HORA_CHROMIUM")
    if named:
        return named if os.access(named, os.X_OK) else None
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None


@pytest.fixture(scope="module")
def chromium_executable() -> str:
    """The chromium binary Playwright drives; skips, saying why, when it or Playwright
    is missing."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("BROWSER TESTS SKIPPED: the Python package 'playwright' is not installed "
                    "(pip install -e '.[test]', or make test)")
    executable = chromium_path()
    if executable is None:
        pytest.skip("BROWSER TESTS SKIPPED: no chromium (apt-get install -y chromium, or make "
                    "test; or set HORA_CHROMIUM to a chromium binary)")
    return executable


@pytest.fixture(scope="module")
def browser(chromium_executable: str) -> Iterator[Any]:
    """A headless chromium (Playwright)."""
    from playwright.sync_api import sync_playwright

    executable = chromium_executable
    with sync_playwright() as playwright:
        # --no-sandbox: the tests may run as root, where chromium's sandbox refuses to start.
        launched = playwright.chromium.launch(executable_path=executable, headless=True,
                                              args=["--no-sandbox"], timeout=30_000)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture(scope="module")
def screenshot_dir(tmp_path_factory) -> Path:
    """``docs/`` when ``HORA_UPDATE_SCREENSHOTS=1`` (the README shows them), else a temporary
    folder: a test run does not change the tree unless asked to."""
    if os.environ.get("HORA_UPDATE_SCREENSHOTS") == "1":
        return ROOT / "docs"
    return tmp_path_factory.mktemp("screenshots")


@dataclass
class ElasticJob:
    """A 3-rank elastic job under ``horarun --coordinator`` against a standalone coordinator.

    The worker on :data:`SLOW_HOST` naps :data:`NAP_S` seconds in every step.
    """

    coordinator: CoordinatorProcess
    job_id: str
    proc: subprocess.Popen[bytes]
    stop_file: Path
    log_file: Path
    slow_host: str = SLOW_HOST
    killed: list[int] = field(default_factory=list)

    @property
    def page_url(self) -> str:
        return f"{self.coordinator.http_url}/jobs/{self.job_id}"

    def get(self, path: str) -> Any:
        """A REST answer of the coordinator (JSON), with a deadline."""
        answer = httpx.get(self.coordinator.http_url + path, timeout=5)
        answer.raise_for_status()
        return answer.json()

    def telemetry(self) -> dict[str, Any]:
        return self.get(f"/api/v1/jobs/{self.job_id}/telemetry")

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")

    def wait(self, what: str, ok: Callable[[dict[str, Any]], bool],
             timeout: float = 60.0) -> dict[str, Any]:
        """Polls the telemetry until ``ok`` holds; fails naming ``what`` and the last answer."""
        deadline = time.monotonic() + timeout
        seen: dict[str, Any] = {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"horarun exited ({self.proc.returncode}) while waiting "
                                     f"for {what}; its output:\n{self.log()[-4000:]}")
            try:
                seen = self.telemetry()
            except httpx.HTTPStatusError:
                seen = {}
            if seen and ok(seen):
                return seen
            time.sleep(0.2)
        raise AssertionError(f"{what} did not happen within {timeout} s; last telemetry: "
                             f"{seen}\nhorarun's output:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        """Asks every rank to stop at the same step, then waits for horarun (bounded)."""
        self.stop_file.touch()
        try:
            self.proc.wait(45)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _ready(t: dict[str, Any]) -> bool:
    """3 active ranks with figures, and the slow host named the straggler."""
    ranks = t["ranks"]
    return (len(ranks) == 3 and all(r["state"] == "active" and r["reported"] and r["steps"] >= 20
                                    and r["rounds"] >= 20 for r in ranks)
            and t["stragglers"]["is_straggler"] and t["stragglers"]["host"] == SLOW_HOST
            and bool(t["series"]))


@pytest.fixture(scope="module")
def elastic_job(tmp_path_factory) -> Iterator[ElasticJob]:
    """A running :class:`ElasticJob` whose ranks have reported steps and rounds."""
    tmp = tmp_path_factory.mktemp("dashboard-job")
    hosts = tmp / "hosts.txt"
    hosts.write_text("".join(f"{host}:1\n" for host in HOSTS))
    discover = tmp / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    # A first round waits one lease for the launched world: long enough for three workers
    # importing torch at once on two cores.
    coordinator = CoordinatorProcess(["--lease-s", "5"]).start()
    log_file = tmp / "horarun.log"
    job = "dash-job"
    # The coordinator's HTTP port, so that horarun prints the dashboard URL.
    command = [*HORARUN, "-np", "3", "--min-np", "2", "--max-np", "3",
               "--host-discovery-script", str(discover), "--coordinator",
               coordinator.grpc_address, "--coordinator-http-port", str(coordinator.http_port),
               "--job-id", job, sys.executable, str(JOB_SCRIPT), str(tmp / "stop"), SLOW_HOST,
               str(NAP_S)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HORA_TOKEN": coordinator.token,
           "HORA_START_TIMEOUT": "60"}
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                stdin=subprocess.DEVNULL)
    running = ElasticJob(coordinator, job, proc, tmp / "stop", log_file)
    try:
        running.wait("3 ranks reporting steps, with the slow host the straggler", _ready, 75)
        yield running
    finally:
        running.stop()
        coordinator.stop()
        print(f"----- horarun output ({log_file}) -----\n{running.log()[-6000:]}")
        coordinator.dump_log(sys.stdout)
