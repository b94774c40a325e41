"""hora on a real Ray cluster of two nodes, each a network namespace (a "machine").

``ray start --head`` on h1 and ``ray start --address`` on h2 (see
support/ray_cluster.py); the driver scripts run on h1 with plain ``python``,
as Ray users start them. One cluster serves the module; every test stops
what it started.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_report import RESULTS, SKIPPED, TIMINGS
from ray_cluster import RayCluster, RayUnavailable, ray_missing

pytestmark = [pytest.mark.clusters, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
_MISSING = ray_missing()
if _MISSING:
    SKIPPED["ray"] = (f"SKIPPED hora on Ray (tests/clusters/test_ray.py): missing "
                      f"{', '.join(_MISSING)}; run 'make cluster-deps' (root)")
    pytest.skip(SKIPPED["ray"], allow_module_level=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    workdir = tmp_path_factory.mktemp("ray")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / p) for p in ("client_sdk", "services", "native", "proto")]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    began = time.monotonic()
    try:
        with RayCluster(workdir, env) as ray_cluster:
            ray_cluster.start_head(num_cpus=1)
            ray_cluster.add_node("h2", num_cpus=1)
            ray_cluster.wait_nodes(2)
            TIMINGS["ray cluster start (2 nodes)"] = time.monotonic() - began
            yield ray_cluster
    except RayUnavailable as exc:
        SKIPPED["ray"] = f"SKIPPED hora on Ray (tests/clusters/test_ray.py): {exc}"
        pytest.skip(SKIPPED["ray"])


def _drive(cluster: RayCluster, argv: list[str], name: str, timeout: float = 240) -> dict:
    log = cluster.workdir / f"{name}.log"
    proc = cluster.driver([sys.executable, *argv], log)
    try:
        proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    output = log.read_text(errors="replace")
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"{name} exited {proc.returncode}:\n{output[-6000:]}\n{cluster.logs()}")
    return json.loads(lines[-1][len("RESULT "):])


def test_digits_on_two_nodes(cluster: RayCluster) -> None:
    """RayExecutor trains the digits example on 2 ranks, one per node."""
    began = time.monotonic()
    results = _drive(cluster, [str(ROOT / "examples" / "ray_digits.py"), "--address",
                               cluster.address, "--num-workers", "2", "--epochs", "8"],
                     "ray_digits")
    TIMINGS["ray_digits.py (fixed, 2 ranks)"] = time.monotonic() - began
    RESULTS["ray_digits.py (RayExecutor)"] = "; ".join(
        f"rank {r['rank']} on {r.get('host', '?')}: accuracy {r['accuracy']:.4f}, "
        f"parameters {r['params']}" for r in results)
    assert [r["rank"] for r in results] == [0, 1]
    assert {r["host"] for r in results} == {cluster.head.address,
                                           cluster.host("h2").address}
    assert all(r["accuracy"] >= 0.90 for r in results), results
    assert len({r["params"] for r in results}) == 1, results


def test_horovod_driver_and_errors(cluster: RayCluster) -> None:
    """An unchanged horovod.ray script under ``python -m hora.horovod``: placement by
    num_hosts, results in rank order, and each failure named."""
    out = _drive(cluster, ["-m", "hora.horovod", str(Path(__file__).parent /
                                                      "ray_horovod_driver.py"),
                           cluster.address], "ray_horovod_driver")
    TIMINGS["RayExecutor.start (2 ranks, 2 nodes)"] = out["start_s"]
    run = out["run"]
    assert [r["rank"] for r in run] == [0, 1]
    assert [r["sum"] for r in run] == [21.0, 21.0]
    assert all(r["module"] == "horovod.torch" for r in run)
    h2 = cluster.host("h2").address
    assert {r["host"] for r in run} == {cluster.head.address, h2}
    assert [r["cross_rank"] for r in run] == [0, 1]
    assert sorted(out["dashboard"], key=lambda r: r["rank"]) == [
        {"rank": r["rank"], "host": r["host"], "pid": r["pid"]} for r in run]
    assert out["execute_single"] == "chief"
    assert out["run_remote"] == ["remote", "remote"]

    raised = out["raised"]
    assert raised["rank"] == 1
    assert f"rank 1 (node {run[1]['host']}, actor pid {run[1]['pid']})" in raised["message"]
    assert "ValueError: rank 1 gives up" in raised["message"]
    assert "raises_on_rank_1" in raised["message"]  # the worker's traceback

    died = out["died"]
    assert died["rank"] == 1
    assert f"rank 1 (node {run[1]['host']}, actor pid {run[1]['pid']}) died" in died["message"]

    too_big = out["too_big"]
    assert "3 bundles of CPU=1" in too_big["message"]
    assert "the cluster has CPU=2 in all" in too_big["message"]
    assert f"node {h2} CPU=1" in too_big["message"]
    assert too_big["seconds"] < 20
    unplaceable = out["unplaceable"]
    assert "CPU=1.5" in unplaceable["message"]
    assert "did not place the workers within timeout_s=8 s" in unplaceable["message"]
    assert unplaceable["seconds"] < 20


def _wait_for(log: Path, proc, pattern: str, after: int, timeout: float) -> tuple[int, str]:
    """Waits for a line containing ``pattern`` past line ``after`` of ``log``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = log.read_text(errors="replace").splitlines()
        for number, line in enumerate(lines[after:], start=after):
            if pattern in line:
                return number + 1, line
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in the driver's output within {timeout:g} s:\n"
                         + "\n".join(log.read_text(errors="replace").splitlines()[-40:]))


def _commit_time(line: str) -> float:
    found = re.search(r"world \d+ at (\d+\.\d+)", line)
    assert found, line
    return float(found.group(1))


@pytest.mark.timeout(600)
def test_elastic_node_dies_and_joins(cluster: RayCluster) -> None:
    """ElasticRayExecutor: the second node dies mid-run and the survivor goes on from its
    last commit; a third node joins and takes part from the next commit."""
    log = cluster.workdir / "ray_elastic.log"
    began = time.monotonic()
    proc = cluster.driver([sys.executable, str(ROOT / "examples" / "ray_digits.py"),
                           "--address", cluster.address, "--elastic", "--min-workers", "1",
                           "--max-workers", "2", "--epochs", "6", "--batch-sleep", "0.2",
                           "--batches-per-commit", "4"], log)
    try:
        at, _ = _wait_for(log, proc, "world 2 at", 0, 300)
        TIMINGS["ElasticRayExecutor: first commit of 2 ranks"] = time.monotonic() - began
        killed = time.time()
        cluster.kill_node("h2")
        at, line = _wait_for(log, proc, "world 1 at", at, 120)
        TIMINGS["Ray elastic recovery (node killed -> first commit of the survivor)"] = (
            _commit_time(line) - killed)
        cluster.add_node("h3", num_cpus=1)
        added = time.time()
        at, line = _wait_for(log, proc, "world 2 at", at, 150)
        TIMINGS["Ray node added -> first commit with it"] = _commit_time(line) - added
        proc.wait(240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    output = log.read_text(errors="replace")
    assert proc.returncode == 0, output[-6000:]
    results = json.loads(output.splitlines()[-1][len("RESULT "):])
    RESULTS["ray_digits.py --elastic (h2 killed, h3 added)"] = "; ".join(
        f"rank {r['rank']} on {r.get('host', '?')}: accuracy {r['accuracy']:.4f}, "
        f"parameters {r['params']}" for r in results)
    assert [r["rank"] for r in results] == [0, 1]
    assert {r["host"] for r in results} == {cluster.head.address, cluster.host("h3").address}
    assert len({r["params"] for r in results}) == 1, results
    assert all(r["accuracy"] >= 0.90 for r in results), results
    assert f"{cluster.host('h2').address}" in output  # the driver said which node it lost
