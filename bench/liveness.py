"""Liveness: from a worker's failure to the survivors' reaction, 3 workers.

    python bench/liveness.py                 # driver: prints the markdown table
    python bench/liveness.py --runs 5

Each run starts 3 workers (one per simulated host) that allreduce in a loop
against a standalone coordinator with its default settings, then fails worker
2 in one of three ways:

- ``kill -9``: the process dies; the kernel closes its sockets, so the
  coordinator sees its negotiation stream break at once;
- ``SIGSTOP``: the process stops and closes nothing; only its lease running
  out tells the coordinator;
- link down: the worker's network link goes down (its host vanishes without
  closing anything); only the lease tells. Each worker runs in a network
  namespace of its own, joined to the coordinator's by a veth pair on a
  bridge; ``ip link set ... down`` in the worker's namespace cuts it off. Needs
  root (``ip netns``); without it these rows say "not measured", and the other
  rows run on loopback.

Non-elastic job: the time until the slower survivor's collective raises
(HorovodInternalError / RankLostError). Elastic job (min 2, max 3): the time
until the slower survivor's reset callback runs, in the new generation of 2
(the failure notice, the re-rendezvous, the new process group and the state
sync included). Target: at most 3 s for both.

A baseline row runs SIGSTOP against a coordinator with the settings of
before (``--lease-s 10 --stall-check-interval-s 1``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import common

ROOT = common.BENCH_DIR.parent
SOURCE_PATHS = [ROOT / "client_sdk", ROOT / "services", ROOT / "native", ROOT / "proto"]
WORKERS = 3
VICTIM = 2
TARGET_S = 3.0
SUBNET = "10.231.0"
NS_COORDINATOR = "hora-lv-c"


def _ns_worker(index: int) -> str:
    return f"hora-lv-w{index}"


# ------------------------------------------------------------------- worker


def worker(out: Path, index: int, elastic: bool) -> None:
    """Allreduces until something fails; writes when (and how) it noticed."""
    import torch

    import hora.torch as hvd

    torch.set_num_threads(1)

    def report(kind: str, detail: str) -> None:
        path = out / f"result.{index}"
        tmp = out / f"result.{index}.tmp"  # one per worker: "result.tmp" was shared
        tmp.write_text(json.dumps({"time": time.time(), "kind": kind, "detail": detail[:300]}))
        tmp.replace(path)

    hvd.init()
    x = torch.ones(1024)
    if not elastic:
        steps = 0
        try:
            while True:
                hvd.allreduce(x, name="grad", op=hvd.Sum)
                steps += 1
                if steps == 20:
                    (out / f"ready.{index}").write_text(str(os.getpid()))
                time.sleep(0.005)
        except hvd.HorovodInternalError as exc:
            report("error", f"{type(exc).__name__}: {exc}")
        os._exit(0)  # a stopped peer never answers: do not wait on a clean shutdown

    state = hvd.elastic.ObjectState(steps=0)

    def on_reset() -> None:
        report("reset", f"new world of {hvd.size()}")
        os._exit(0)

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state: hvd.elastic.ObjectState) -> None:
        while True:
            hvd.allreduce(x, name="grad", op=hvd.Sum)
            state.steps += 1
            if state.steps == 20:
                (out / f"ready.{index}").write_text(str(os.getpid()))
            if state.steps % 10 == 0:
                state.commit()
            time.sleep(0.005)

    train(state)


# ------------------------------------------------------------------- driver


def environment() -> dict[str, str]:
    env = {**os.environ, **common.THREAD_ENV, "PYTHONUNBUFFERED": "1"}
    paths = [str(p) for p in SOURCE_PATHS] + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Network:
    """Namespaces: the coordinator's, holding a bridge, and one per worker on a veth."""

    def __init__(self) -> None:
        self.up = False

    def create(self) -> bool:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            return False
        try:
            self.destroy()
            _ip("netns", "add", NS_COORDINATOR)
            _ip("-n", NS_COORDINATOR, "link", "set", "lo", "up")
            _ip("-n", NS_COORDINATOR, "link", "add", "br0", "type", "bridge")
            _ip("-n", NS_COORDINATOR, "addr", "add", f"{SUBNET}.1/24", "dev", "br0")
            _ip("-n", NS_COORDINATOR, "link", "set", "br0", "up")
            for i in range(WORKERS):
                ns = _ns_worker(i)
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", NS_COORDINATOR, "link", "add", f"vb{i}", "type", "veth", "peer",
                    "name", f"vw{i}", "netns", ns)
                _ip("-n", NS_COORDINATOR, "link", "set", f"vb{i}", "master", "br0")
                _ip("-n", NS_COORDINATOR, "link", "set", f"vb{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", f"vw{i}")
                _ip("-n", ns, "link", "set", f"vw{i}", "up")
        except (OSError, subprocess.CalledProcessError) as exc:
            common.log(f"network namespaces unavailable: {exc}")
            self.destroy()
            return False
        self.up = True
        return True

    @staticmethod
    def address(index: int) -> str:
        return f"{SUBNET}.{10 + index}"

    def link(self, index: int, up: bool) -> None:
        _ip("-n", _ns_worker(index), "link", "set", f"vw{index}", "up" if up else "down")

    def destroy(self) -> None:
        for ns in [NS_COORDINATOR, *(_ns_worker(i) for i in range(WORKERS))]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self.up = False

    def prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns] if self.up else []


class Coordinator:
    """A standalone coordinator, in the coordinator's namespace when there is one."""

    def __init__(self, network: Network, workdir: Path, args: Sequence[str]) -> None:
        host = f"{SUBNET}.1" if network.up else "127.0.0.1"
        self.token = secrets.token_hex(8)
        name = f"coordinator-{uuid.uuid4().hex[:8]}"
        ready = workdir / f"{name}.json"
        self.log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [*network.prefix(NS_COORDINATOR), sys.executable, "-m", "hora_coordinator",
             "--host", host, "--ready-file", str(ready), "--token", self.token, *args],
            env=environment(), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not start: see {workdir}")
            time.sleep(0.05)
        self.address = f"{host}:{json.loads(ready.read_text())['grpc_port']}"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@dataclass(frozen=True)
class Scenario:
    label: str
    failure: str  # kill, stop, link
    elastic: bool
    coordinator_args: tuple[str, ...] = ()


SCENARIOS = [
    Scenario("non-elastic: kill -9 -> survivors raise", "kill", False),
    Scenario("non-elastic: SIGSTOP -> survivors raise", "stop", False),
    Scenario("non-elastic: link down -> survivors raise", "link", False),
    Scenario("elastic: kill -9 -> survivors reset", "kill", True),
    Scenario("elastic: SIGSTOP -> survivors reset", "stop", True),
    Scenario("elastic: link down -> survivors reset", "link", True),
    Scenario("baseline, settings before (lease 10 s, checks every 1 s): non-elastic SIGSTOP "
             "-> survivors raise", "stop", False,
             ("--lease-s", "10", "--stall-check-interval-s", "1")),
]


def one_run(scenario: Scenario, network: Network, coordinator: Coordinator,
            workdir: Path) -> float | None:
    out = workdir / uuid.uuid4().hex[:8]
    out.mkdir()
    job = f"liveness-{out.name}"
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for i in range(WORKERS):
            env = environment()
            env.update(HORA_COORDINATOR=coordinator.address, HORA_TOKEN=coordinator.token,
                       HORA_JOB_ID=job, HORA_SIZE=str(WORKERS), HORA_HOSTNAME=f"host{i}",
                       HORA_DATA_PLANE_ADDRESS=network.address(i) if network.up
                       else "127.0.0.1")
            if scenario.elastic:
                env.update(HORA_MIN_SIZE="2", HORA_MAX_SIZE=str(WORKERS))
            else:
                env["HORA_RANK"] = str(i)
            log = open(out / f"worker{i}.log", "wb")  # noqa: SIM115 (closed below)
            logs.append(log)
            argv = [*network.prefix(_ns_worker(i)), sys.executable, __file__, "--worker",
                    str(out), "--index", str(i)] + (["--elastic"] if scenario.elastic else [])
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 120
        while not all((out / f"ready.{i}").exists() for i in range(WORKERS)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                common.log(f"{scenario.label}: the workers did not start (see {out})")
                return None
            time.sleep(0.05)
        time.sleep(0.5)
        victim = int((out / f"ready.{VICTIM}").read_text())
        started = time.time()
        if scenario.failure == "kill":
            os.kill(victim, signal.SIGKILL)
        elif scenario.failure == "stop":
            os.kill(victim, signal.SIGSTOP)
        else:
            network.link(VICTIM, up=False)
        survivors = [i for i in range(WORKERS) if i != VICTIM]
        deadline = time.monotonic() + 60
        while not all((out / f"result.{i}").exists() for i in survivors):
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- worker {i}:\n" + "\n".join(
                        (out / f"worker{i}.log").read_text(errors="replace").splitlines()[-8:])
                    for i in survivors)
                common.log(f"{scenario.label}: the survivors did not notice in 60 s:\n{tails}")
                return None
            time.sleep(0.01)
        results = [json.loads((out / f"result.{i}").read_text()) for i in survivors]
        expected = "reset" if scenario.elastic else "error"
        if any(r["kind"] != expected for r in results):
            common.log(f"{scenario.label}: unexpected outcome {results}")
            return None
        return max(r["time"] for r in results) - started
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
        if scenario.failure == "link" and network.up:
            network.link(VICTIM, up=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help="worker mode: the output directory")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--elastic", action="store_true")
    parser.add_argument("--runs", type=int, default=1 if common.SETTINGS.quick else 3)
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker), args.index, args.elastic)
        return
    network = Network()
    namespaces = network.create()
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="hora-bench-liveness-") as tmp:
            workdir = Path(tmp)
            coordinators: dict[tuple[str, ...], Coordinator] = {}
            for scenario in SCENARIOS:
                if scenario.failure == "link" and not namespaces:
                    rows.append([scenario.label, "0", common.MISSING, common.MISSING,
                                 f"{TARGET_S:g}", "not measured: needs root (ip netns)"])
                    continue
                if scenario.coordinator_args not in coordinators:
                    coordinators[scenario.coordinator_args] = Coordinator(
                        network, workdir, scenario.coordinator_args)
                coordinator = coordinators[scenario.coordinator_args]
                runs = [one_run(scenario, network, coordinator, workdir)
                        for _ in range(args.runs)]
                done = [r for r in runs if r is not None]
                common.log(f"{scenario.label}: {[round(r, 2) for r in done]}")
                rows.append([scenario.label, f"{len(done)} of {len(runs)}",
                             common.fmt(common.median(done) if done else None),
                             common.fmt(max(done) if done else None), f"{TARGET_S:g}", ""])
            for coordinator in coordinators.values():
                coordinator.stop()
    finally:
        network.destroy()
    where = ("each worker in a network namespace of its own, on a bridge in the "
             "coordinator's" if namespaces else "loopback (no network namespaces)")
    notes = [
        f"3 workers, one per simulated host ({where}); worker 2 fails. Seconds from the "
        f"failure to the slower survivor's reaction: the collective raising "
        f"(non-elastic) or the reset callback running in the new world of 2 (elastic). "
        f"Coordinator with its default settings (lease 2 s, checks every 0.25 s) unless "
        f"the row says otherwise.",
    ]
    common.emit(common.section(
        "6. liveness: a failed worker -> the survivors' error or reset (hora only)",
        common.table(["scenario", "runs", "median s", "max s", "target s", "note"], rows),
        notes, compares_horovod=False))


if __name__ == "__main__":
    main()
