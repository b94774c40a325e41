"""allreduce across hosts: hora against direct Gloo, over TCP between network stacks.

    python bench/cross_host.py          # driver (root): prints the markdown tables
    make bench-hosts                    # the same, installing OpenSSH first if missing

The hosts are network namespaces on a bridge, each running a real sshd
(``tests/support/ssh_hosts.py``, the multi-host tests' machinery): h1 and h2,
plus a client namespace that launches. Bytes between the hosts cross two veth
pairs and a bridge, never loopback, and each host has a private ``/dev/shm``,
so hora's mesh cannot use shared memory between them, as on two machines.

Per topology (2 hosts × 1 rank, 2 hosts × 2 ranks), in interleaved launches:

- hora: ``horarun -np N -H h1:K,h2:K -p 2222 -i KEY`` from the client
  namespace, workers started over ssh, coordinator embedded in the client.
- direct Gloo: N plain processes, K in each host's namespace, meeting
  through torch's TCPStore on rank 0 (h1), ``GLOO_SOCKET_IFNAME=eth0``.

Each worker times one float32 tensor allreduced (sum, in place, waited on)
at 4 KiB to 64 MiB, then 100 tensors of 4 KiB per step (all enqueued
async, then all waited on; Gloo one by one). hora's workers also record
which data plane carried each size: the agreement round's own exchange
(the bytes ride it, up to ``HORA_MESH_ALLREDUCE_BYTES`` per round, split
among the peers), swaps between pairs of ranks (``PairwiseAllreduce``:
through ``/dev/shm`` with a rank on the same host, over TCP across hosts),
or Gloo.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
from common import GLOO, HORA, SETTINGS, fmt, ratio, size_label

ROOT = common.BENCH_DIR.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))
from ssh_hosts import SshHosts, SshHostsUnavailable, missing_tools  # noqa: E402

SOURCE_PATHS = [ROOT / "client_sdk", ROOT / "services", ROOT / "native", ROOT / "proto"]
KIB, MIB = 1 << 10, 1 << 20
SIZES = [4 * KIB, 64 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]
QUICK_SIZES = [4 * KIB, 1 * MIB]
ITERS = {4 * KIB: 50, 64 * KIB: 30, 1 * MIB: 10, 4 * MIB: 5, 16 * MIB: 3, 64 * MIB: 1}
SMALL_TENSORS, SMALL_BYTES = 100, 4 * KIB
WARMUP = 3
REPS = 3 if SETTINGS.quick else 5
SMALL_STEPS = 2 if SETTINGS.quick else 3
ROUNDS = 1 if SETTINGS.quick else 2
TOPOLOGIES = [(2, 1), (2, 2)]  # (hosts, ranks per host)
GLOO_PORT = 29500


# ------------------------------------------------------------------- worker


def worker(system: str, out: str, sizes: list[int]) -> None:
    import torch

    common.set_one_thread()
    comm = common.Comm(system)
    comm.init()
    engine: Any = None
    if system == HORA:
        from hora._runtime import current

        engine = current().engine
    result: dict[str, Any] = {"sizes": {}, "mesh_rounds": {}, "pair": {}, "shm_swaps": {}}
    for nbytes in sizes:
        tensor = torch.zeros(nbytes // 4, dtype=torch.float32)
        name = f"bench.cross.{nbytes}"
        before = engine.mesh_batches if engine is not None else 0
        pair_before = engine.pairwise_allreduces if engine is not None else 0
        swaps_before = engine._mesh.transport.shared_swaps if engine is not None else 0
        iters = ITERS.get(nbytes, 5)
        result["sizes"][str(nbytes)] = common.time_reps(
            lambda t=tensor, n=name: comm.allreduce_(t, n), warmup=WARMUP, reps=REPS,
            iters=iters)
        if engine is not None:
            # Batches the mesh reduced from payloads its rounds carried: every op
            # of this size (warm-up excepted, which may still negotiate) when the
            # mesh carried it, none when Gloo did.
            result["mesh_rounds"][str(nbytes)] = [engine.mesh_batches - before,
                                                  WARMUP + REPS * iters]
            result["pair"][str(nbytes)] = engine.pairwise_allreduces - pair_before
            result["shm_swaps"][str(nbytes)] = engine._mesh.transport.shared_swaps - swaps_before
    tensors = [torch.zeros(SMALL_BYTES // 4) for _ in range(SMALL_TENSORS)]
    names = [f"bench.cross.small.{i}" for i in range(SMALL_TENSORS)]

    def step() -> None:
        handles = [comm.allreduce_async_(t, n) for t, n in zip(tensors, names, strict=True)]
        for handle in handles:
            comm.wait(handle)

    result["small"] = common.time_reps(step, warmup=WARMUP, reps=REPS, iters=SMALL_STEPS)
    if engine is not None and engine._mesh is not None:
        result["mesh"] = {"shared": engine._mesh.transport.shared,
                          "budget": engine._mesh.budget}
    common.write_result(out, comm.rank, result)
    comm.shutdown()


# ------------------------------------------------------------------- driver


def _env(**extra: str) -> dict[str, str]:
    paths = [str(p) for p in SOURCE_PATHS] + [os.environ.get("PYTHONPATH", "")]
    return {**os.environ, **common.THREAD_ENV, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(p for p in paths if p), **extra}


def _read(out_dir: Path, size: int, system: str, rc: int, text: str,
          wall: float) -> common.LaunchResult:
    ranks, error = [], ""
    try:
        for rank in range(size):
            ranks.append(json.loads((out_dir / f"rank{rank}.json").read_text()))
    except (OSError, ValueError) as exc:
        tail = "\n".join(text.strip().splitlines()[-15:])
        error = f"rc={rc}, {type(exc).__name__}: {exc}"
        common.log(f"{system} np={size} FAILED ({error}); output tail:\n{tail}")
        ranks = []
    common.log(f"{system} np={size} across hosts: {wall:.1f} s")
    return common.LaunchResult(system, size, ranks, wall, error)


def launch_hora(cluster: SshHosts, hosts: int, per_host: int,
                sizes: list[int]) -> common.LaunchResult:
    size = hosts * per_host
    out_dir = Path(tempfile.mkdtemp(prefix="hora-bench-cross-hora-"))
    spec = ",".join(f"{h.name}:{per_host}" for h in cluster.hosts[:hosts])
    argv = [*cluster.client.prefix, sys.executable, "-m", "hora.runner.launch", "-np", str(size),
            "-H", spec, *cluster.launcher_flags(), sys.executable, __file__, "--worker", HORA,
            "--out", str(out_dir), "--sizes", *map(str, sizes)]
    env = {**_env(), "HORA_SSH_COMMAND": cluster.launcher_env()["HORA_SSH_COMMAND"]}
    start = time.perf_counter()
    rc, text = common._run(argv, env, SETTINGS.launch_timeout)
    result = _read(out_dir, size, HORA, rc, text, time.perf_counter() - start)
    shutil.rmtree(out_dir, ignore_errors=True)
    return result


def launch_gloo(cluster: SshHosts, hosts: int, per_host: int,
                sizes: list[int]) -> common.LaunchResult:
    size = hosts * per_host
    out_dir = Path(tempfile.mkdtemp(prefix="hora-bench-cross-gloo-"))
    master = cluster.hosts[0].address
    procs: list[subprocess.Popen[str]] = []
    logs = []
    start = time.perf_counter()
    deadline = time.monotonic() + SETTINGS.launch_timeout
    rc = 0
    try:
        for rank in range(size):
            host = cluster.hosts[rank // per_host]
            log = tempfile.TemporaryFile("w+")
            logs.append(log)
            env = _env(MASTER_ADDR=master, MASTER_PORT=str(GLOO_PORT), RANK=str(rank),
                       WORLD_SIZE=str(size), LOCAL_RANK=str(rank % per_host),
                       GLOO_SOCKET_IFNAME="eth0")
            procs.append(subprocess.Popen(
                [*host.prefix, sys.executable, __file__, "--worker", GLOO, "--out",
                 str(out_dir), "--sizes", *map(str, sizes)],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=ROOT, text=True))
        for proc in procs:
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = -1
            rc = rc or code
            if code != 0:
                break
    finally:
        for proc in procs:  # one failed or timed out: the others would wait forever
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = ""
    for rank, log in enumerate(logs):
        log.seek(0)
        text += "".join(f"[{rank}] {line}" for line in log)
        log.close()
    result = _read(out_dir, size, GLOO, rc, text, time.perf_counter() - start)
    shutil.rmtree(out_dir, ignore_errors=True)
    return result


def _busbw(nbytes: int, seconds: float | None, size: int) -> float | None:
    if seconds is None:
        return None
    return nbytes / seconds / 1e9 * 2 * (size - 1) / size


def _path(runs: list[common.LaunchResult], nbytes: int) -> str:
    """Which data plane carried hora's ops of this size, from rank 0's counts."""
    counts = [r.rank0["mesh_rounds"][str(nbytes)] for r in runs if r.ok]
    if not counts:
        return common.MISSING
    carried = sum(c[0] for c in counts)
    total = sum(c[1] for c in counts)
    shared = any(r.rank0.get("mesh", {}).get("shared") for r in runs if r.ok)
    paired = sum(r.rank0["pair"][str(nbytes)] for r in runs if r.ok)
    if carried >= total - WARMUP * len(counts):
        return "mesh round, shared memory" if shared else "mesh round, TCP"
    if paired >= total - WARMUP * len(counts):
        if any(r.rank0["shm_swaps"][str(nbytes)] for r in runs if r.ok):
            return "pairwise swaps: /dev/shm within a host, TCP across"
        return "pairwise swaps, TCP"
    if carried == 0 and paired == 0:
        return "Gloo"
    return f"mesh round {carried}, pairwise {paired}, rest Gloo (of {total})"


def main() -> None:
    parser = common.worker_args()
    parser.add_argument("--sizes", type=int, nargs="*", default=None)
    ns = parser.parse_args()
    sizes = ns.sizes or (QUICK_SIZES if SETTINGS.quick else SIZES)
    if ns.worker:
        worker(ns.worker, ns.out, sizes)
        return
    missing = missing_tools()
    if missing:
        common.log(f"cannot run: missing {', '.join(missing)} (make hosts-deps, as root)")
        sys.exit(2)
    started = time.monotonic()
    runs: dict[tuple[int, int], dict[str, list[common.LaunchResult]]] = {}
    with tempfile.TemporaryDirectory(prefix="hora-bench-hosts-") as tmp:
        try:
            cluster = SshHosts(Path(tmp), count=2).start()
        except SshHostsUnavailable as exc:
            common.log(f"cannot make the namespace hosts: {exc}")
            sys.exit(2)
        try:
            for topology in TOPOLOGIES:
                found: dict[str, list[common.LaunchResult]] = {HORA: [], GLOO: []}
                for _ in range(ROUNDS):
                    found[HORA].append(launch_hora(cluster, *topology, sizes))
                    found[GLOO].append(launch_gloo(cluster, *topology, sizes))
                runs[topology] = found
        finally:
            cluster.close()

    def seconds(topology: tuple[int, int], system: str, key: str) -> float | None:
        pick = (lambda r: r["small"]) if key == "small" else (lambda r: r["sizes"][key])
        samples = common.pooled(runs[topology][system], pick)
        return common.median(samples) if samples else None

    rows, small_rows = [], []
    for topology in TOPOLOGIES:
        hosts, per_host = topology
        size = hosts * per_host
        label = f"{hosts} hosts × {per_host} rank{'s' if per_host > 1 else ''}"
        for nbytes in sizes:
            t = {s: seconds(topology, s, str(nbytes)) for s in (HORA, GLOO)}
            bw = {s: _busbw(nbytes, v, size) for s, v in t.items()}
            rows.append([label, size_label(nbytes),
                         fmt(None if t[HORA] is None else t[HORA] * 1e3, 3),
                         fmt(None if t[GLOO] is None else t[GLOO] * 1e3, 3),
                         fmt(bw[HORA], 3), fmt(bw[GLOO], 3), ratio(bw[HORA], bw[GLOO]),
                         _path(runs[topology][HORA], nbytes)])
        t = {s: seconds(topology, s, "small") for s in (HORA, GLOO)}
        small_rows.append([label, f"{SMALL_TENSORS} × 4 KiB",
                           fmt(None if t[HORA] is None else t[HORA] * 1e3, 2),
                           fmt(None if t[GLOO] is None else t[GLOO] * 1e3, 2),
                           ratio(t[GLOO], t[HORA])])
    failures = [r for found in runs.values() for rs in found.values() for r in rs if not r.ok]
    reps = (f"median of {REPS} repetitions after {WARMUP} warm-up ops in each of {ROUNDS} "
            f"interleaved launch(es) per system and topology")
    common.emit(common.section(
        "8. allreduce across hosts (network namespaces, TCP between them)",
        common.table(["hosts × ranks", "size", "hora ms", "Gloo ms", "hora busbw GB/s",
                      "Gloo busbw GB/s", "busbw hora/Gloo", "hora's data plane"], rows),
        [f"One float32 tensor, sum in place, waited on; {reps}. busbw = bytes / time × "
         f"2(n−1)/n. Target: busbw hora/Gloo ≥ 1.0 from 1 MiB up."],
        failures, compares_horovod=False))
    common.emit(common.section(
        "8b. many small tensors across hosts (all enqueued, then all waited on)",
        common.table(["hosts × ranks", "workload", "hora ms/step", "Gloo ms/step (one by one)",
                      "speed hora/Gloo"], small_rows),
        [f"Median of {REPS} repetitions of {SMALL_STEPS} steps after {WARMUP} warm-up steps "
         f"in each of {ROUNDS} interleaved launch(es) per system and topology; speed = Gloo "
         f"time / hora time. Target: ≥ 2."],
        compares_horovod=False))
    common.emit(f"_Whole run: {time.monotonic() - started:.0f} s._")


if __name__ == "__main__":
    main()
