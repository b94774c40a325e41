"""Elastic training end to end: horarun in elastic mode, a real coordinator, real Gloo.

Hosts are loopback aliases (127.0.0.2, 127.0.0.3, ...) listed by a discovery
script whose output the test controls through a file.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
HORARUN = [sys.executable, "-m", "hora.runner.launch"]
WORKER = Path(__file__).with_name("elastic_worker.py")
SAMPLES = 240


def discovery(tmp_path: Path, hosts: list[str]) -> tuple[Path, Path]:
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text("\n".join(hosts) + "\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    script.chmod(0o755)
    return script, hosts_file


def start(tmp_path: Path, script: Path, np: int, min_np: int, max_np: int,
          worker_args: list[str], extra: list[str] = ()) -> subprocess.Popen:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    cmd = HORARUN + ["-np", str(np), "--min-np", str(min_np), "--max-np", str(max_np),
                     "--host-discovery-script", str(script), *extra,
                     sys.executable, str(WORKER), str(out), *worker_args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                           "HORA_START_TIMEOUT": "60"})


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"horarun did not finish in {timeout} s\n{out[-3000:]}\n"
                             f"{err[-5000:]}") from None
    return out, err


def reports(tmp_path: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("report.*.json"))]


def wait_for_progress(tmp_path: Path, steps: int, timeout: float) -> None:
    progress = tmp_path / "out" / "progress"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if progress.exists():
            text = progress.read_text().split()
            if text and int(text[0]) >= steps:
                return
        time.sleep(0.1)
    raise AssertionError(f"training did not reach step {steps} within {timeout} s")


@pytest.mark.timeout(240)
def test_kill_one_of_three_survivors_continue_from_their_last_commit(tmp_path):
    script, _ = discovery(tmp_path, ["127.0.0.2:1", "127.0.0.3:1", "127.0.0.4:1"])
    proc = start(tmp_path, script, 3, 2, 3,
                 ["--kill-rank", "2", "--kill-step", "12", "--step-sleep", "0.01"])
    out, err = finish(proc, 200)
    assert proc.returncode == 0, err[-5000:]
    done = reports(tmp_path)
    assert len(done) == 2, (out[-2000:], err[-4000:])
    for report in done:
        # The survivors are the processes that started: no restart.
        assert report["pid"] == report["start_pid"]
        assert report["size"] == 2 and report["params_identical"]
        assert 3 in report["sizes"] and report["sizes"][-1] == 2, report["sizes"]
        # Every sample of every epoch was applied exactly once: the step the
        # victim died in was rolled back on the survivors and done again.
        for epoch, applied in enumerate(report["applied"]):
            counts = collections.Counter(applied)
            assert sorted(counts) == list(range(SAMPLES)), f"epoch {epoch} lost samples"
            assert max(counts.values()) == 1, f"epoch {epoch} applied samples twice"
    assert done[0]["params"] == done[1]["params"]
    assert "lost" in err or "SIGKILL" in err or "blacklist" in err


@pytest.mark.timeout(240)
def test_new_host_joins_at_the_next_commit_and_the_world_grows(tmp_path):
    script, hosts = discovery(tmp_path, ["127.0.0.2:1", "127.0.0.3:1"])
    proc = start(tmp_path, script, 2, 2, 3, ["--step-sleep", "0.05", "--epochs", "2",
                                             "--hold-at-step", "20", "--hold-until-size", "3"])
    wait_for_progress(tmp_path, 10, 90)
    hosts.write_text("127.0.0.2:1\n127.0.0.3:1\n127.0.0.4:1\n")
    out, err = finish(proc, 200)
    assert proc.returncode == 0, err[-5000:]
    done = reports(tmp_path)
    assert len(done) == 3, (out[-2000:], err[-4000:])
    newcomer = [r for r in done if r["host"] == "127.0.0.4"]
    assert len(newcomer) == 1 and newcomer[0]["size"] == 3
    assert all(r["params_identical"] and r["params"] == done[0]["params"] for r in done)
    for report in done:
        if report["host"] != "127.0.0.4":
            assert 2 in report["sizes"] and 3 in report["sizes"], report["sizes"]
        for applied in report["applied"]:
            counts = collections.Counter(applied)
            assert sorted(counts) == list(range(SAMPLES)), "a sample was lost"
            # Re-partitioning 2 -> 3 workers may pad the epoch's rest by up to 2 samples.
            assert sum(counts.values()) - SAMPLES <= 2


@pytest.mark.timeout(240)
def test_a_host_whose_worker_keeps_failing_is_blacklisted(tmp_path):
    script, _ = discovery(tmp_path, ["127.0.0.2:1", "127.0.0.3:1", "127.0.0.4:1"])
    proc = start(tmp_path, script, 3, 2, 3,
                 ["--fail-on-host", "127.0.0.4", "--step-sleep", "0.02", "--epochs", "1"])
    out, err = finish(proc, 200)
    assert proc.returncode == 0, err[-5000:]
    assert "blacklisting 127.0.0.4" in err, err[-4000:]
    assert err.count("failing on purpose") == 1, "a blacklisted host was used again"
    assert len(reports(tmp_path)) == 2


@pytest.mark.timeout(240)
def test_a_blacklisted_host_comes_back_after_its_cooldown(tmp_path):
    script, _ = discovery(tmp_path, ["127.0.0.2:1", "127.0.0.3:1", "127.0.0.4:1"])
    proc = start(tmp_path, script, 3, 2, 3,
                 ["--fail-on-host", "127.0.0.4", "--step-sleep", "0.1", "--epochs", "1"],
                 extra=["--blacklist-cooldown-range", "1", "2"])
    out, err = finish(proc, 200)
    assert proc.returncode == 0, err[-5000:]
    assert err.count("failing on purpose") >= 2, "the host was not tried again after cooldown"


@pytest.mark.timeout(120)
def test_fewer_workers_than_min_np_fail_after_the_elastic_timeout(tmp_path):
    script, _ = discovery(tmp_path, ["127.0.0.2:1"])
    started = time.monotonic()
    proc = start(tmp_path, script, 2, 2, 3, [], extra=["--elastic-timeout", "3"])
    out, err = finish(proc, 100)
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    assert "at least 2" in err and "1" in err, err[-3000:]
    assert 3 <= elapsed < 60
