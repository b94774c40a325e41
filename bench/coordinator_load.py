"""Coordinator load: simulated workers (bench/locustfile.py) against a fresh coordinator.

    make bench-coordinator                         # every scenario, twice
    .venv/bin/python bench/coordinator_load.py --scenario 10k --repeat 1

Each run starts a standalone ``hora-coordinator`` with its default settings,
then locust, headless, with one user per simulated worker; the swarm in the
locustfile measures and writes a JSON summary, which this script turns into
one table row. Load generator and coordinator share this machine's cores, so
every figure includes that contention (the generator's own CPU is printed).

Scenarios: 1,000 workers in one job; 100 jobs of 10 workers; 10,000 workers in
100 jobs of 100; and, for comparison, the same 10,000 with the client's
heartbeats as they were before they moved onto the negotiation stream (a
unary Heartbeat call every second).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import common
from load_swarm import Samples, latencies

ROOT = common.BENCH_DIR.parent
LOCUSTFILE = common.BENCH_DIR / "locustfile.py"
SOURCE_PATHS = [ROOT / "client_sdk", ROOT / "services", ROOT / "native", ROOT / "proto"]


@dataclass(frozen=True)
class Scenario:
    key: str
    label: str
    workers: int
    job_size: int
    spawn_rate: int
    heartbeat: str = "stream"


SCENARIOS = [
    Scenario("1k", "1,000 workers, 1 job", 1000, 1000, 1000),
    Scenario("100x10", "100 jobs × 10 workers", 1000, 10, 500),
    Scenario("10k", "10,000 workers, 100 jobs × 100", 10_000, 100, 500),
    Scenario("10k-unary", "10,000 workers, 100 jobs × 100, unary heartbeat every 1 s "
             "(client before this change)", 10_000, 100, 500, heartbeat="unary"),
]
TARGETS = ("targets at 10,000 workers: heartbeat p99 < 50 ms, negotiation p99 < 100 ms, "
           "coordinator < 1 core; 1,000-worker world assembled < 2 s; leaves O(N) messages")


def environment() -> dict[str, str]:
    env = {**os.environ, **common.THREAD_ENV, "PYTHONUNBUFFERED": "1",
           "LOCUST_SKIP_MONKEY_PATCH": "1"}
    paths = [str(p) for p in SOURCE_PATHS] + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


class Coordinator:
    """A standalone ``python -m hora_coordinator`` on free loopback ports."""

    def __init__(self, workdir: Path, args: list[str]) -> None:
        self.token = secrets.token_hex(8)
        ready = workdir / "ready.json"
        self.log = open(workdir / "coordinator.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hora_coordinator", "--ready-file", str(ready),
             "--token", self.token, "--log-level", "WARNING", *args],
            env=environment(), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not start: see {workdir}")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        self.grpc = f"127.0.0.1:{info['grpc_port']}"
        self.http = f"http://127.0.0.1:{info['http_port']}"
        self.pid = info["pid"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def run(scenario: Scenario, steady_s: float, tensor_every: float,
        coordinator_args: list[str]) -> dict:
    """One scenario against a fresh coordinator; the swarm's summary (or a failure)."""
    with tempfile.TemporaryDirectory(prefix="hora-load-") as tmp:
        workdir = Path(tmp)
        keep = Path(tempfile.gettempdir()) / f"hora-load-{scenario.key}-last.log"
        out = workdir / "summary.json"
        coordinator = Coordinator(workdir, coordinator_args)
        spawn_s = scenario.workers / scenario.spawn_rate
        cap = int(spawn_s + steady_s + 240)
        argv = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
                "--only-summary", "--loglevel", "WARNING",
                "-u", str(scenario.workers), "-r", str(scenario.spawn_rate),
                "--run-time", f"{cap}s", "--stop-timeout", "0",
                "--hora-address", coordinator.grpc, "--hora-http", coordinator.http,
                "--hora-token", coordinator.token, "--hora-pid", str(coordinator.pid),
                "--hora-job-size", str(scenario.job_size),
                "--hora-heartbeat", scenario.heartbeat,
                "--hora-steady-s", str(steady_s), "--hora-tensor-every", str(tensor_every),
                "--hora-out", str(out)]
        probe_out = workdir / "probe.json"
        probe = subprocess.Popen(
            [sys.executable, str(common.BENCH_DIR / "load_swarm.py"), "--address",
             coordinator.grpc, "--token", coordinator.token, "--out", str(probe_out)],
            env=environment(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started = time.perf_counter()
        try:
            result = subprocess.run(argv, env=environment(), cwd=ROOT, capture_output=True,
                                    text=True, timeout=cap + 180, check=False)
            text = result.stdout + result.stderr
        except subprocess.TimeoutExpired as exc:
            text = f"locust timed out: {exc}"
        finally:
            probe.send_signal(signal.SIGTERM)
            try:
                probe.wait(60)
            except subprocess.TimeoutExpired:
                probe.kill()
                probe.wait()
            rss_end = _rss_mib(coordinator.pid)
            coordinator.stop()
        wall = time.perf_counter() - started
        keep.write_bytes((workdir / "coordinator.log").read_bytes())
        if not out.exists():
            tail = "\n".join(text.strip().splitlines()[-20:])
            common.log(f"{scenario.key}: no summary (coordinator log: {keep}); locust output "
                       f"tail:\n{tail}")
            return {"failure": "no summary written", "wall_s": wall}
        summary = json.loads(out.read_text())
        summary["wall_s"] = wall
        if probe_out.exists() and "steady_window" in summary:
            probe_summary = json.loads(probe_out.read_text())
            samples = Samples(**{k: [tuple(x) for x in v]
                                 for k, v in probe_summary["samples"].items()})
            summary["probe"] = latencies(samples, *summary["steady_window"])
            summary["probe"]["errors"] = probe_summary.get("errors")
        summary.setdefault("coordinator_rss_mib", rss_end)
        common.log(f"{scenario.key} ({scenario.heartbeat}): {wall:.0f} s, steady window "
                   f"{summary.get('steady_window')}, errors {summary.get('errors')}, "
                   f"failure {summary.get('failure')}")
        return summary


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _p(s: dict, kind: str) -> str:
    return f"{common.fmt(s.get(f'{kind}_p50_ms'), 1)} / {common.fmt(s.get(f'{kind}_p99_ms'), 1)}"


def row(scenario: Scenario, run_no: int, s: dict) -> list[str]:
    assembled = s.get("assemble_s") or []
    ready = s.get("ready_s") or []
    m = s.get("metrics_steady") or {}
    probe = s.get("probe") or {}
    errors = sum((s.get("errors") or {}).values()) + sum((probe.get("errors") or {}).values())
    lease = (f"{common.fmt(m.get('hora_heartbeat_interval_seconds'), 1)} / "
             f"{common.fmt(m.get('hora_lease_seconds'), 1)}")
    if scenario.heartbeat == "unary":
        lease = f"1.0 (fixed) / {common.fmt(m.get('hora_lease_seconds'), 1)}"
    return [
        scenario.label, str(run_no),
        f"{common.fmt(median(assembled) if assembled else None)} / "
        f"{common.fmt(max(assembled) if assembled else None)}",
        common.fmt(max(ready) if ready else None),
        _p(probe, "heartbeat"), _p(probe, "negotiation"),
        _p(s, "heartbeat"), _p(s, "negotiation"), _p(s, "loop_lag"),
        common.fmt(s.get("coordinator_cpu")),
        common.fmt(s.get("coordinator_rss_mib"), 0),
        common.fmt(s.get("generator_cpu")),
        lease,
        " / ".join(f"{x:.1f}" for x in s.get("loadavg") or []) or common.MISSING,
        str(errors) + (f" ({s['failure']})" if s.get("failure") else ""),
    ]


def leave_row(scenario: Scenario, run_no: int, s: dict) -> list[str] | None:
    before, after = s.get("metrics_before_leaves"), s.get("metrics_after_leaves")
    if not before or not after or not s.get("leaves"):
        return None
    key = "hora_stream_messages_total"
    sent = after.get(key, 0) - before.get(key, 0)
    return [scenario.label, str(run_no), str(s["leaves"]), f"{sent:.0f}",
            f"{sent / s['leaves']:.2f}", common.fmt(s.get("leave_s"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", action="append", choices=[s.key for s in SCENARIOS],
                        help="run only these (repeatable); default: all")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each scenario")
    parser.add_argument("--steady-s", type=float, default=30.0,
                        help="seconds measured once every job is assembled")
    parser.add_argument("--tensor-every", type=float, default=10.0,
                        help="seconds between new tensors negotiated by every rank of a job")
    parser.add_argument("--coordinator-arg", action="append", default=[],
                        help="extra hora-coordinator flag (repeatable), e.g. --heartbeat-budget=4000")
    args = parser.parse_args()
    chosen = [s for s in SCENARIOS if not args.scenario or s.key in args.scenario]
    rows, leaves = [], []
    for scenario in chosen:
        for run_no in range(1, args.repeat + 1):
            summary = run(scenario, args.steady_s, args.tensor_every, args.coordinator_arg)
            rows.append(row(scenario, run_no, summary))
            leave = leave_row(scenario, run_no, summary)
            if leave is not None:
                leaves.append(leave)
    header = ["scenario", "run", "world assembled median / max s", "first step on every rank s",
              "probe heartbeat p50 / p99 ms", "probe negotiation p50 / p99 ms",
              "swarm heartbeat p50 / p99 ms", "swarm negotiation p50 / p99 ms",
              "swarm loop lag p50 / p99 ms", "coordinator CPU cores", "coordinator RSS MiB",
              "load generator CPU cores", "heartbeat interval / lease s",
              "machine load average, start / end", "errors"]
    notes = [
        f"Steady window: {args.steady_s:g} s once every job is assembled; each rank negotiates "
        f"one new tensor every {args.tensor_every:g} s. Assembled: from the job's Joins (all "
        f"sent at once) to the last world view; first step: store bootstrap, stream open and "
        f"8 tensors negotiated on every rank. Coordinator CPU from /proc/PID/stat over the "
        f"steady window, in cores; RSS at its end.",
        "Probe: a job of 2 simulated workers in a process of its own (what a real worker "
        "sees; it heartbeats every 0.5 s, being small, and negotiates a new tensor every "
        "second). Swarm: every simulated worker, measured on the load generator's one event "
        "loop, so its figures include that loop's own queueing (its lag: how late it wakes "
        "a 50 ms sleep).",
        "Load generator (locust + grpc.aio, one process), probe and coordinator share the "
        "2 cores, and other jobs on this machine share them too: the 1-minute load average "
        "at the window's start and end shows how much (2.0 = both cores busy).",
        TARGETS + ".",
    ]
    common.emit(common.section("Coordinator under load (simulated workers, locust)",
                               common.table(header, rows), notes, compares_horovod=False))
    if leaves:
        common.emit(common.section(
            "Leaves: stream messages the coordinator queued while every worker left",
            common.table(["scenario", "run", "leaves", "stream messages", "per leave",
                          "all Leave calls done s"], leaves),
            ["hora_stream_messages_total on /metrics before the first Leave and 1 s after the "
             "last (departure notices are coalesced and go out at the periodic checks); "
             "heartbeat answers are not counted there."], compares_horovod=False))


if __name__ == "__main__":
    main()
