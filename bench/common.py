"""Shared code of the benchmark scripts: settings, launching, timing, tables.

Every script in ``bench/`` is both a driver and a worker. Run plainly, it
launches itself once per system (hora, direct Gloo, Horovod) and rank count,
in worker mode (``--worker SYSTEM --out DIR``), then reads what the workers
wrote to ``DIR/rank{R}.json`` and prints a markdown table.

This module is imported by workers running under Horovod's virtualenv too,
so it needs only the standard library and torch, and never imports hora.

Environment (read once, into :data:`SETTINGS`):
    HORA_BENCH_HOROVOD: path of a virtualenv holding Horovod 0.28.1; unset
        means Horovod is not measured.
    HORA_BENCH_QUICK: ``1`` shrinks every measurement for a smoke run.
    HORA_BENCH_TIMEOUT: seconds one launch may take (default 300).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"

HORA = "hora"
GLOO = "gloo"
HOROVOD = "horovod"
NAMES = {HORA: "hora", GLOO: "direct Gloo", HOROVOD: "Horovod"}

HOROVOD_MISSING = "Horovod: not measured (set HORA_BENCH_HOROVOD=/path/to/venv)"
MISSING = "—"

# Every process runs on one thread: the machine has 2 cores and 2-4 ranks.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True)
class BenchSettings:
    """What the environment asked for."""

    horovod_venv: Path | None
    quick: bool
    launch_timeout: float

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> BenchSettings:
        env = dict(os.environ if env is None else env)
        venv = env.get("HORA_BENCH_HOROVOD", "").strip()
        return cls(
            horovod_venv=Path(venv) if venv else None,
            quick=env.get("HORA_BENCH_QUICK", "").strip() not in ("", "0"),
            launch_timeout=float(env.get("HORA_BENCH_TIMEOUT", "300")),
        )

    def systems(self) -> list[str]:
        """hora first, then the baselines that will be measured."""
        return [HORA, GLOO] + ([HOROVOD] if self.horovod_venv else [])


SETTINGS = BenchSettings.from_env()


def log(message: str) -> None:
    """Progress goes to stderr so that stdout is only the markdown."""
    print(f"bench: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- launching


@dataclass
class LaunchResult:
    """What one launch of ``size`` workers produced."""

    system: str
    size: int
    ranks: list[dict[str, Any]]  # each rank's JSON, by rank; empty on failure
    wall_s: float
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def rank0(self) -> dict[str, Any]:
        return self.ranks[0] if self.ranks else {}


def free_port() -> int:
    """A port free right now on 127.0.0.1 (the race until use is harmless here)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _venv_bin(name: str, venv: Path | None = None) -> str:
    if venv is not None:
        return str(venv / "bin" / name)
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name) or name


def _run(argv: Sequence[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Runs a command in its own session; on timeout kills that session only."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=BENCH_DIR.parent)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -1
        out.seek(0)
        text = out.read()
    if rc == -1:
        text += f"\n(timed out after {timeout:.0f} s)"
    return rc, text


def _spawn_gloo(script: str, args: Sequence[str], size: int, env: dict[str, str],
                timeout: float) -> tuple[int, str]:
    """Starts ``size`` plain processes that meet through torch's TCPStore (env://).

    The store is hosted here, before the workers start, as torchrun's agent
    does (``TORCHELASTIC_USE_AGENT_STORE``): horarun's coordinator and
    horovodrun's rendezvous server are up before their workers too. When rank
    0 hosts it instead, the other ranks often connect before it listens and
    back off for about 0.4 s, which would be timed as init in section 4.
    """
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
    port = store.port
    env = {**env, "TORCHELASTIC_USE_AGENT_STORE": "True"}
    procs = []
    outs = []
    deadline = time.monotonic() + timeout
    for rank in range(size):
        out = tempfile.TemporaryFile("w+")
        outs.append(out)
        rank_env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen(
            [sys.executable, script, *args], env=rank_env, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True, cwd=BENCH_DIR.parent))
    rc = 0
    for proc in procs:
        try:
            code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = -1
        rc = rc or code
        if code != 0:
            break
    for proc in procs:  # one failed or timed out: the others would hang
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = ""
    for rank, out in enumerate(outs):
        out.seek(0)
        text += "".join(f"[{rank}] {line}" for line in out)
        out.close()
    del store
    if rc == -1:
        text += f"\n(timed out after {timeout:.0f} s)"
    return rc, text


def launch(system: str, script: str, size: int, args: Sequence[str] = (),
           launcher_args: Sequence[str] = (), timeout: float | None = None) -> LaunchResult:
    """Runs ``script --worker SYSTEM --out DIR ARGS`` on ``size`` ranks of ``system``.

    ``system`` is hora (``horarun``), gloo (plain processes and env://),
    horovod (``horovodrun --gloo`` of HORA_BENCH_HOROVOD), or single (one
    plain process). A failure is returned, not raised, so that one broken
    system leaves the others' figures in the table.
    """
    timeout = timeout or SETTINGS.launch_timeout
    out_dir = Path(tempfile.mkdtemp(prefix=f"hora-bench-{system}-"))
    script = str(Path(script).resolve())
    worker_args = ["--worker", system, "--out", str(out_dir), *args]
    env = {**os.environ, **THREAD_ENV}
    start = time.perf_counter()
    if system == HORA:
        argv = [_venv_bin("horarun"), "-np", str(size), *launcher_args,
                sys.executable, script, *worker_args]
        rc, text = _run(argv, env, timeout)
    elif system == HOROVOD:
        venv = SETTINGS.horovod_venv
        if venv is None:
            raise ValueError("Horovod launched without HORA_BENCH_HOROVOD")
        env.pop("PYTHONPATH", None)
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(venv)
        argv = [_venv_bin("horovodrun", venv), "-np", str(size), "-H", f"localhost:{size}",
                "--gloo", *launcher_args, _venv_bin("python", venv), script, *worker_args]
        rc, text = _run(argv, env, timeout)
    elif system in (GLOO, "single"):
        rc, text = _spawn_gloo(script, worker_args, size, env, timeout)
    else:
        raise ValueError(f"unknown system {system!r}")
    wall = time.perf_counter() - start
    ranks = []
    error = ""
    try:
        for rank in range(size):
            ranks.append(json.loads((out_dir / f"rank{rank}.json").read_text()))
    except (OSError, ValueError) as exc:
        tail = "\n".join(text.strip().splitlines()[-15:])
        error = f"rc={rc}, {type(exc).__name__}: {exc}"
        log(f"{system} np={size} FAILED ({error}); output tail:\n{tail}")
        ranks = []
    shutil.rmtree(out_dir, ignore_errors=True)
    log(f"{system} np={size} {' '.join([Path(script).name, *args])}: {wall:.1f} s")
    return LaunchResult(system, size, ranks, wall, error)


def launch_rounds(systems: Sequence[str], rounds: int, script: str, size: int,
                  args_for: Callable[[str], tuple[list[str], list[str]]] | None = None,
                  ) -> dict[str, list[LaunchResult]]:
    """Launches every system ``rounds`` times, interleaved (a, b, c, a, b, c).

    A burst of load from other processes on this shared machine then lands
    on all systems alike instead of on whichever happened to run during it.
    ``args_for(system)`` gives (worker args, launcher args).
    """
    runs: dict[str, list[LaunchResult]] = {s: [] for s in systems}
    for _ in range(rounds):
        for s in systems:
            args, launcher_args = args_for(s) if args_for else ([], [])
            runs[s].append(launch(s, script, size, args, launcher_args))
    return runs


def pooled(runs: Sequence[LaunchResult], pick: Callable[[dict[str, Any]], list[float]],
           ) -> list[float]:
    """Rank 0's samples from every successful launch, pooled for one median."""
    return [x for run in runs if run.ok for x in pick(run.rank0)]


# ------------------------------------------------------------------- worker


def worker_args(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The arguments every script takes; worker mode when ``--worker`` is given."""
    parser = parser or argparse.ArgumentParser()
    parser.add_argument("--worker", choices=[HORA, GLOO, HOROVOD, "single"])
    parser.add_argument("--out", help="directory for rank{R}.json (worker mode)")
    return parser


def env_rank() -> tuple[int, int]:
    """Rank and size from the launcher's environment, before any init."""
    for rank_var, size_var in (("HORA_RANK", "HORA_SIZE"), ("HOROVOD_RANK", "HOROVOD_SIZE"),
                               ("RANK", "WORLD_SIZE")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def write_result(out_dir: str, rank: int, result: dict[str, Any]) -> None:
    path = Path(out_dir) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)


def file_barrier(out_dir: str, name: str, rank: int, size: int, timeout: float = 120) -> None:
    """All ranks meet through files, so that no system under test is used to align them."""
    Path(out_dir, f"{name}.{rank}").touch()
    deadline = time.monotonic() + timeout
    while not all(Path(out_dir, f"{name}.{r}").exists() for r in range(size)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"file barrier {name!r}: not all {size} ranks arrived")
        time.sleep(0.001)


def set_one_thread() -> None:
    import torch

    torch.set_num_threads(1)


class Comm:
    """The few collectives the benchmarks need, over hora, Horovod or torch.distributed.

    hora and Horovod share Horovod's API, so one code path serves both; Gloo
    is called directly (``dist.all_reduce`` in place, ``async_op`` for async).
    """

    def __init__(self, system: str) -> None:
        self.system = system
        self.hvd: Any = None
        if system == HORA:
            import hora.torch as hvd

            self.hvd = hvd
        elif system == HOROVOD:
            import horovod.torch as hvd

            self.hvd = hvd

    def init(self) -> None:
        if self.hvd is not None:
            self.hvd.init()
        else:
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method="env://")

    @property
    def rank(self) -> int:
        if self.hvd is not None:
            return self.hvd.rank()
        import torch.distributed as dist

        return dist.get_rank()

    @property
    def size(self) -> int:
        if self.hvd is not None:
            return self.hvd.size()
        import torch.distributed as dist

        return dist.get_world_size()

    def allreduce_(self, tensor: Any, name: str) -> None:
        """In-place sum, waited on."""
        if self.hvd is not None:
            self.hvd.allreduce_(tensor, name=name, op=self.hvd.Sum)
        else:
            import torch.distributed as dist

            dist.all_reduce(tensor)

    def allreduce_async_(self, tensor: Any, name: str) -> Any:
        if self.hvd is not None:
            return self.hvd.allreduce_async_(tensor, name=name, op=self.hvd.Sum)
        import torch.distributed as dist

        return dist.all_reduce(tensor, async_op=True)

    def wait(self, handle: Any) -> None:
        if self.hvd is not None:
            self.hvd.synchronize(handle)
        else:
            handle.wait()

    def shutdown(self) -> None:
        if self.hvd is not None:
            self.hvd.shutdown()
        else:
            import torch.distributed as dist

            dist.destroy_process_group()


# ------------------------------------------------------------------- timing


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def time_reps(fn: Callable[[], None], *, warmup: int, reps: int, iters: int) -> list[float]:
    """Seconds per call of ``fn``: ``warmup`` untimed calls, then ``reps`` timed batches.

    Each repetition times ``iters`` calls and divides, so that timer overhead
    is negligible for short ops; callers take the median of the list.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - start) / iters)
    return times


# ------------------------------------------------------------------- tables


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return MISSING
    return f"{value:.{digits}f}"


def ratio(num: float | None, den: float | None) -> str:
    if num is None or den is None or den == 0:
        return MISSING
    return f"{num / den:.2f}"


def size_label(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def section(title: str, body: str, notes: Sequence[str] = (),
            failures: Sequence[LaunchResult] = (), compares_horovod: bool = True) -> str:
    """A markdown section: title, table, then notes (Horovod missing, failures)."""
    parts = [f"## {title}", "", body, ""]
    if SETTINGS.horovod_venv is None and compares_horovod:
        parts.append(f"_{HOROVOD_MISSING}_  ")
    for failed in failures:
        parts.append(f"_{NAMES.get(failed.system, failed.system)} at {failed.size} ranks "
                     f"failed: {failed.error}_  ")
    parts.extend(f"{note}  " for note in notes)
    return "\n".join(parts).rstrip() + "\n"


def emit(markdown: str) -> None:
    print(markdown, flush=True)
