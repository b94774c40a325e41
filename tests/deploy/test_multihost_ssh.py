"""``horovodrun -H`` across real hosts: network namespaces, each running a real sshd.

Three "machines" (h1, h2, h3) and a fourth namespace that launches, on one
bridge (:mod:`support.ssh_hosts`): real ``/usr/bin/ssh`` with key
authentication against real ``/usr/sbin/sshd`` on port 2222, real TCP between
network stacks, a private ``/dev/shm`` per host. Nothing is stood in:
horovodrun, its ssh guard, the coordinator it embeds, Gloo and hora's mesh
all run as in production.

Run on their own (as root, with iproute2 and OpenSSH; ``make hosts-deps``
installs the latter)::

    make test-hosts

Skipped, with one loud reason, when the machine cannot (not root, no ``ip``,
no sshd).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ssh_hosts import SshHosts, missing_tools, running_hosts

_MISSING = missing_tools()
if _MISSING:
    pytest.skip(
        "!!! SKIPPED issue 13 part 4, multi-host horovodrun over real sshd "
        f"(tests/deploy/test_multihost_ssh.py): missing {', '.join(_MISSING)}; "
        "run `make hosts-deps` as root !!!", allow_module_level=True)

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
HORA_PATHS = [ROOT / "client_sdk", ROOT / "services", ROOT / "native", ROOT / "proto"]
HOROVODRUN = [sys.executable, "-m", "hora.runner.launch", "--horovod-compat"]


@pytest.fixture(scope="module")
def ssh_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHosts]:
    """h1, h2, h3 with sshd, and a client namespace, for the whole module."""
    def skip(why: str) -> None:
        pytest.skip(f"!!! SKIPPED multi-host horovodrun over real sshd: no network "
                    f"namespaces here: {why} !!!")

    with running_hosts(tmp_path_factory.mktemp("ssh-hosts"), 3, skip) as cluster:
        yield cluster


def _env(cluster: SshHosts, **extra: str) -> dict[str, str]:
    # The remote workers get this environment through the ssh connection, so the
    # source tree travels as PYTHONPATH, as an installed hora would need nothing.
    paths = [str(p) for p in HORA_PATHS] + [os.environ.get("PYTHONPATH", "")]
    return cluster.launcher_env(PYTHONPATH=os.pathsep.join(p for p in paths if p),
                                PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)


def _horovodrun(cluster: SshHosts, args: list[str], timeout: float, cwd: Path,
                **env: str) -> subprocess.CompletedProcess[str]:
    """Runs horovodrun in the client namespace to completion."""
    return subprocess.run([*cluster.client.prefix, *HOROVODRUN, *args], cwd=cwd,
                          env=_env(cluster, **env), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _lines(stdout: str) -> dict[str, list[str]]:
    """Output lines by their horovodrun prefix (``[0]``, ``[h1:0]``)."""
    found: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        label, sep, text = line.partition("<stdout>:")
        if sep:
            found.setdefault(label.strip("[]"), []).append(text)
    return found


@pytest.mark.timeout(240)
def test_the_seeds_training_example_runs_on_two_hosts(ssh_cluster: SshHosts,
                                                      tmp_path: Path) -> None:
    done = _horovodrun(
        ssh_cluster,
        ["-np", "4", "-H", "h1:2,h2:2", *ssh_cluster.launcher_flags(),
         sys.executable, "examples/elastic/train.py", "--epochs", "1"],
        timeout=220, cwd=ROOT, OCI__SYNC_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    assert "[0]<stdout>:Test set: Average loss:" in done.stdout, done.stdout[-3000:]
    # The seed counts epochs from 1 and names a checkpoint after the next one.
    assert (tmp_path / "artifacts" / "ckpts" / "checkpoint-2.pth.tar").exists()


HOROVOD_SCRIPT = """
import json, os, sys
import torch
import horovod.torch as hvd

hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="total")
# 4 MiB, twice: negotiated, then cached; both by swaps between pairs of ranks
# (through /dev/shm with the rank on the same host, over TCP with the other host):
# one backend choice for both paths, as for "total" (negotiated) above.
for step in range(2):
    big = hvd.allreduce(torch.arange(1 << 20, dtype=torch.float32) * (hvd.rank() + 1),
                        op=hvd.Sum, name="big")
    assert torch.equal(big, torch.arange(1 << 20, dtype=torch.float32) * 10), step
gathered = hvd.allgather_object(os.environ["HOROVOD_HOSTNAME"])
from hora._runtime import current
engine = current().engine
mesh = engine._mesh
print(json.dumps({
    "rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
    "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
    "cross_size": hvd.cross_size(), "host": os.environ["HOROVOD_HOSTNAME"],
    "ssh": os.environ.get("SSH_CONNECTION", ""), "sum": total.item(),
    "hosts": gathered, "shm": mesh.transport.shared,
    "local_peers": sorted(mesh.transport.local_peers), "shm_swaps": mesh.transport.shared_swaps,
    "pairwise": engine.pairwise_allreduces, "netns": os.readlink("/proc/self/ns/net"),
}))
hvd.shutdown()
"""


@pytest.mark.timeout(120)
def test_an_unchanged_horovod_script_runs_on_two_hosts(ssh_cluster: SshHosts,
                                                       tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(HOROVOD_SCRIPT)
    done = _horovodrun(ssh_cluster, ["-np", "4", "-H", "h1:2,h2:2",
                                     *ssh_cluster.launcher_flags(), sys.executable, str(script)],
                       timeout=100, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    results = {int(label): json.loads(lines[0])
               for label, lines in _lines(done.stdout).items()}
    assert sorted(results) == [0, 1, 2, 3], done.stdout
    h1, h2 = ssh_cluster.host("h1"), ssh_cluster.host("h2")
    for rank, out in results.items():
        host = h1 if rank < 2 else h2
        assert out["host"] == host.name
        assert (out["rank"], out["size"], out["local_rank"], out["local_size"]) == \
            (rank, 4, rank % 2, 2)
        assert (out["cross_rank"], out["cross_size"]) == (rank // 2, 2)
        assert out["sum"] == 10.0
        assert out["hosts"] == ["h1", "h1", "h2", "h2"]
        # Started by the real sshd of that host (SSH_CONNECTION: client ip, port,
        # server ip, server port), inside its network namespace.
        assert out["ssh"].split()[0::2] == [ssh_cluster.client.address, host.address]
        assert out["ssh"].split()[3] == str(ssh_cluster.port)
    netns = {rank: out["netns"] for rank, out in results.items()}
    assert netns[0] == netns[1] != netns[2] == netns[3]
    # Each host has its own /dev/shm, as separate machines do: hora's mesh found
    # that out. Its rounds carry payloads over TCP; the three allreduces the rounds
    # did not carry ("total" negotiated, the 4 MiB negotiated and cached) went by
    # swaps between pairs of ranks, through /dev/shm only with the rank on the
    # same host.
    assert not any(out["shm"] for out in results.values())
    for rank, out in results.items():
        assert out["local_peers"] == [rank ^ 1], out
        assert out["pairwise"] == 3 and out["shm_swaps"] >= 1, out


SLEEPER = """
import os, sys, time
from pathlib import Path
run_dir = Path(sys.argv[1])
name = f"{os.environ['HOROVOD_RANK']}.pid"
(run_dir / (name + ".tmp")).write_text(str(os.getpid()))
(run_dir / (name + ".tmp")).rename(run_dir / name)
time.sleep(120)
"""


@pytest.mark.timeout(90)
def test_killing_horovodrun_leaves_no_process_on_any_host(ssh_cluster: SshHosts,
                                                          tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text(SLEEPER)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    h1, h2 = ssh_cluster.host("h1"), ssh_cluster.host("h2")
    log = tmp_path / "horovodrun.log"
    with open(log, "wb") as out:
        # The workers never call hvd.init(): a coordinator at an address nobody
        # listens on keeps the job from embedding one.
        proc = subprocess.Popen(
            [*ssh_cluster.client.prefix, *HOROVODRUN, "--coordinator", "10.77.0.10:9",
             "-np", "4", "-H", "h1:2,h2:2", *ssh_cluster.launcher_flags(), sys.executable,
             str(script), str(run_dir)],
            env=_env(ssh_cluster), stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while len(list(run_dir.glob("*.pid"))) < 4:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"the workers did not start:\n{log.read_text()}"
            time.sleep(0.05)
        on_hosts = {h.name: ssh_cluster.processes(h) for h in (h1, h2)}
        assert all(len(procs) >= 2 for procs in on_hosts.values()), on_hosts
        proc.send_signal(signal.SIGKILL)  # horovodrun gets no chance to clean up
        proc.wait(5)
        left = ssh_cluster.wait_no_processes([h1, h2, ssh_cluster.client], timeout=20)
        assert not left, f"left behind after horovodrun was killed: {left}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(5)


@pytest.mark.timeout(60)
def test_a_host_whose_sshd_is_down_fails_fast_with_ssh_message(ssh_cluster: SshHosts,
                                                               tmp_path: Path) -> None:
    h3 = ssh_cluster.host("h3")
    ssh_cluster.stop_sshd(h3)
    try:
        started = time.monotonic()
        done = _horovodrun(ssh_cluster, ["-np", "2", "-H", "h1:1,h3:1",
                                         *ssh_cluster.launcher_flags(),
                                         sys.executable, "-c", "print('worker started')"],
                           timeout=40, cwd=tmp_path)
        elapsed = time.monotonic() - started
    finally:
        ssh_cluster.start_sshd(h3)
    assert done.returncode == 1, done.stderr
    assert "cannot run commands over ssh on h3: exit code 255 " \
           f"(ssh: connect to host h3 port {ssh_cluster.port}: Connection refused)" \
           in done.stderr, done.stderr
    assert "h1" not in done.stderr.split("cannot run commands over ssh on ")[1].split(".")[0]
    assert "worker started" not in done.stdout
    assert elapsed < 10, f"took {elapsed:.1f} s to fail"


def test_without_the_ssh_port_flag_the_hosts_are_unreachable(ssh_cluster: SshHosts,
                                                              tmp_path: Path) -> None:
    # sshd listens on 2222 only: --ssh-port is what made the other tests work.
    done = _horovodrun(ssh_cluster, ["-np", "2", "-H", "h1:1,h2:1", "--ssh-identity-file",
                                     str(ssh_cluster.key), sys.executable, "-c", "pass"],
                       timeout=40, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    for host in ("h1", "h2"):
        assert f"{host}: exit code 255 (ssh: connect to host {host} port 22: " \
               f"Connection refused)" in done.stderr, done.stderr


ELASTIC = """
import json, os, sys, time
from pathlib import Path
import torch
import horovod.torch as hvd

run_dir = Path(sys.argv[1])
host = os.environ["HOROVOD_HOSTNAME"]
hvd.init()
model = torch.nn.Linear(16, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)


def report(event):
    line = json.dumps({"event": event, "host": host, "step": state.step, "size": hvd.size(),
                       "rank": hvd.rank(), "time": time.time()})
    with open(run_dir / f"{host}.log", "a") as f:
        f.write(line + "\\n")


state.register_reset_callbacks([lambda: report("reset")])


@hvd.elastic.run
def train(state):
    while True:
        stop = torch.tensor([1.0 if (run_dir / "stop").exists() else 0.0])
        if hvd.allreduce(stop, op=hvd.Max, name="stop").item() > 0:
            return
        optimizer.zero_grad()
        model(torch.randn(8, 16)).pow(2).mean().backward()
        optimizer.step()
        state.step += 1
        if state.step % 10 == 0:
            state.commit()
            report("step")
        time.sleep(0.01)


train(state)
report("done")
"""


def _events(run_dir: Path, host: str) -> list[dict[str, object]]:
    path = run_dir / f"{host}.log"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(what: str, condition: Callable[[], bool], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, \
            f"{what} within {timeout:g} s; horovodrun said:\n{log.read_text()[-4000:]}"
        time.sleep(0.1)


@pytest.mark.timeout(180)
def test_an_elastic_job_survives_a_host_cut_off(ssh_cluster: SshHosts, tmp_path: Path) -> None:
    script = tmp_path / "elastic.py"
    script.write_text(ELASTIC)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    hosts = ssh_cluster.hosts
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\n" + "".join(f"echo {h.address}:1\n" for h in hosts))
    discover.chmod(0o755)
    victim = ssh_cluster.host("h3")
    log = tmp_path / "horovodrun.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*ssh_cluster.client.prefix, *HOROVODRUN, "-np", "3", "--min-np", "2",
             "--host-discovery-script", str(discover), "--network-interface", "eth0",
             *ssh_cluster.launcher_flags(), sys.executable, str(script), str(run_dir)],
            env=_env(ssh_cluster), stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=tmp_path)
    try:
        addresses = [h.address for h in hosts]
        _wait("every host trained", lambda: all(
            any(e["event"] == "step" and e["size"] == 3 for e in _events(run_dir, a))
            for a in addresses), 90, log)
        cut_at = time.time()
        ssh_cluster.link(victim, up=False)
        survivors = [h.address for h in hosts if h is not victim]

        def carried_on() -> bool:
            return all(any(e["event"] == "step" and e["size"] == 2 and e["time"] > cut_at
                           for e in _events(run_dir, a)) for a in survivors)

        _wait("the others carried on in a world of 2", carried_on, 40, log)
        # ssh to the cut host gives up (ServerAlive), which ends that worker for
        # horovodrun: the host is blacklisted and the job goes on without it.
        _wait("horovodrun let the cut host go",
              lambda: f"blacklisting {victim.address}" in log.read_text(), 40, log)
        (run_dir / "stop").touch()
        assert proc.wait(60) == 0, log.read_text()[-4000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(5)
        ssh_cluster.link(victim, up=True)
    text = log.read_text()
    assert f"worker on {victim.address}" in text, text
    for address in survivors:
        events = _events(run_dir, address)
        assert any(e["event"] == "reset" and e["size"] == 2 for e in events), events
        assert events[-1]["event"] == "done", events
    assert not any(e["event"] == "done" for e in _events(run_dir, victim.address))
    # Once sshd there let the dead connection go, hora's guard ended the worker.
    left = ssh_cluster.wait_no_processes([victim, *(ssh_cluster.host(n) for n in ("h1", "h2")),
                                          ssh_cluster.client], timeout=20)
    assert not left, f"left behind: {left}"
