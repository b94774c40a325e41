"""Runs a function from a scenario file in N real worker processes.

Each worker is a fresh Python process with the environment horarun would
give it; it calls ``hvd.init()`` (unless told not to), runs the function,
and reports its result or its exception back through a pickle file. Tests
compare what every rank returned against a single-process reference.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKER_MAIN = Path(__file__).with_name("worker_main.py")


@dataclass
class WorkerResult:
    """What one rank reported."""

    rank: int
    returncode: int | None
    value: Any = None
    error_type: str | None = None
    error_mro: list[str] = field(default_factory=list)
    error: str | None = None
    traceback: str | None = None
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.error_type is None


class WorkersFailed(AssertionError):
    pass


def worker_env(coordinator: Any, size: int, rank: int, job_id: str,
               extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "HORA_COORDINATOR": coordinator.grpc_address,
        "HORA_TOKEN": coordinator.token,
        "HORA_JOB_ID": job_id,
        "HORA_SIZE": str(size),
        "HORA_RANK": str(rank),
        "HORA_START_TIMEOUT": "30",
        "HORA_CONNECT_TIMEOUT": "10",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    if extra:
        env.update(extra)
    return env


def start_workers(coordinator: Any, size: int, scenario: str | Path, func: str,
                  args: tuple = (), *, job_id: str | None = None, init: bool = True,
                  env: dict[str, str] | None = None,
                  per_rank_env: dict[int, dict[str, str]] | None = None,
                  tmpdir: Path | None = None) -> list[tuple[subprocess.Popen, Path]]:
    """Starts the workers and returns (process, result file) per rank."""
    job_id = job_id or f"test-{uuid.uuid4().hex[:8]}"
    tmpdir = Path(tmpdir or tempfile.mkdtemp(prefix="hora-workers-"))
    args_file = tmpdir / "args.pkl"
    args_file.write_bytes(pickle.dumps(args))
    procs = []
    for rank in range(size):
        extra = dict(env or {})
        extra.update((per_rank_env or {}).get(rank, {}))
        out = tmpdir / f"rank{rank}.pkl"
        cmd = [sys.executable, str(WORKER_MAIN), str(scenario), func, str(args_file), str(out),
               "1" if init else "0"]
        proc = subprocess.Popen(cmd, env=worker_env(coordinator, size, rank, job_id, extra),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append((proc, out))
    return procs


def collect(procs: list[tuple[subprocess.Popen, Path]], timeout: float) -> list[WorkerResult]:
    """Waits for every worker (killing the rest at the deadline) and reads their reports."""
    deadline = time.monotonic() + timeout
    results = []
    for rank, (proc, out) in enumerate(procs):
        try:
            stdout, stderr = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other, _ in procs:
                other.kill()
            stdout, stderr = proc.communicate()
            stderr += f"\n[test harness] rank {rank} killed after {timeout} s"
        result = WorkerResult(rank=rank, returncode=proc.returncode, stdout=stdout, stderr=stderr)
        if out.exists():
            report = pickle.loads(out.read_bytes())
            result.value = report.get("value")
            result.error_type = report.get("error_type")
            result.error_mro = report.get("error_mro", [])
            result.error = report.get("error")
            result.traceback = report.get("traceback")
        results.append(result)
    return results


def describe(results: list[WorkerResult]) -> str:
    parts = []
    for r in results:
        parts.append(f"--- rank {r.rank}: exit {r.returncode}, error {r.error_type}: {r.error}\n"
                     f"{r.traceback or ''}\n[stdout]\n{r.stdout[-3000:]}\n"
                     f"[stderr]\n{r.stderr[-5000:]}")
    return "\n".join(parts)


def run_workers(coordinator: Any, size: int, scenario: str | Path, func: str,
                args: tuple = (), *, timeout: float = 90, expect_ok: bool = True,
                **kwargs: Any) -> list[WorkerResult]:
    """Runs ``func`` from ``scenario`` on ``size`` ranks and returns each rank's result."""
    results = collect(start_workers(coordinator, size, scenario, func, args, **kwargs), timeout)
    if expect_ok and not all(r.ok for r in results):
        raise WorkersFailed(f"{func} failed on some ranks:\n{describe(results)}")
    return results
