"""hora on a real Spark cluster: ``local-cluster[2,1,1024]`` (a standalone master and two
workers, each executor a JVM process of its own) with Debian's Java.

One SparkSession serves the module (Spark's start is the expensive part); it
is stopped, and its JVMs with it, after the last test. The digits example's
functions are the ones trained here.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_report import RESULTS, SKIPPED, TIMINGS

pytestmark = [pytest.mark.clusters, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]


def _missing() -> list[str]:
    missing = []
    if importlib.util.find_spec("pyspark") is None:
        missing.append("pyspark (pip install 'hora[spark]')")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        missing.append("java (apt-get install openjdk-17-jre-headless)")
    return missing


_MISSING = _missing()
if _MISSING:
    SKIPPED["spark"] = (f"SKIPPED hora on Spark (tests/clusters/test_spark.py): missing "
                        f"{', '.join(_MISSING)}; run 'make cluster-deps' (root)")
    pytest.skip(SKIPPED["spark"], allow_module_level=True)

import cloudpickle  # noqa: E402

import hora.spark  # noqa: E402

# This module's functions travel to the executors by value (they cannot import it).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _example() -> Any:
    """examples/spark_digits.py as a module, pickled by value (the executors cannot import it)."""
    spec = importlib.util.spec_from_file_location("spark_digits",
                                                  ROOT / "examples" / "spark_digits.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["spark_digits"] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return module


def _descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid``, with its command line."""
    children: dict[int, list[int]] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(
                b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found: dict[int, str] = {}
    stack = list(children.get(pid, []))
    while stack:
        child = stack.pop()
        found[child] = commands.get(child, "")
        stack.extend(children.get(child, []))
    return found


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    # The standalone workers' folders (executor logs) in the test's directory, not in
    # the pyspark package; read by the JVM that getOrCreate() starts.
    os.environ["SPARK_WORKER_DIR"] = str(tmp_path_factory.mktemp("spark-work"))
    # The executors run this Python (torch, hora), not the first python3 on the PATH.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    began = time.monotonic()
    session = (SparkSession.builder.master("local-cluster[2,1,1024]")
               .appName("hora-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.local.dir", str(tmp_path_factory.mktemp("spark")))
               # Executors start faster on a busy machine (C1 only, one GC thread).
               .config("spark.executor.extraJavaOptions",
                       "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
               .getOrCreate())
    TIMINGS["Spark local-cluster[2,1,1024] start"] = time.monotonic() - began
    gateway = SparkContext._gateway
    jvm = getattr(gateway, "proc", None)
    try:
        yield session
    finally:
        session.stop()
        if gateway is not None:
            gateway.shutdown()
        if jvm is not None and jvm.poll() is None:
            jvm.terminate()
            try:
                jvm.wait(20)
            except Exception:
                jvm.kill()
        SparkContext._gateway = None
        SparkContext._jvm = None


def _rows(spark: Any, example: Any) -> tuple[list, list]:
    train_frame, test_frame = example.digits_frame(spark, 42)
    return ([tuple(r) for r in train_frame.orderBy("id").collect()],
            [tuple(r) for r in test_frame.collect()])


def test_digits_on_two_tasks(spark: Any) -> None:
    """hora.spark.run trains the digits example on 2 barrier tasks (2 executors)."""
    example = _example()
    train_rows, test_rows = _rows(spark, example)
    args = example.parser.parse_args(["--epochs", "8"])
    began = time.monotonic()
    results = hora.spark.run(example.train, args=(train_rows, test_rows, args), num_proc=2)
    TIMINGS["hora.spark.run digits (2 tasks)"] = time.monotonic() - began
    RESULTS["spark_digits (hora.spark.run)"] = "; ".join(
        f"rank {r['rank']} on {r.get('host', '?')}: accuracy {r['accuracy']:.4f}, "
        f"parameters {r['params']}" for r in results)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 for r in results)
    assert all(r["accuracy"] >= 0.90 for r in results), results
    assert len({r["params"] for r in results}) == 1, results

    began = time.monotonic()
    assert hora.spark.run(lambda: __import__("hora.torch").torch.init() and None,
                          num_proc=2) == [None, None]
    TIMINGS["hora.spark.run: a 2-task job, start to end"] = time.monotonic() - began


def _raises_on_rank_1(offset: int) -> int:
    import torch

    import hora.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise KeyError(f"rank 1 has no shard {offset}")
    hvd.allreduce(torch.ones(1), name="after.raise")
    return hvd.rank()


def test_task_that_raises(spark: Any) -> None:
    """A rank that raises fails run() with its rank, executor and traceback; Spark does
    not retry it."""
    with pytest.raises(hora.spark.SparkRunError) as caught:
        hora.spark.run(_raises_on_rank_1, args=(7,), num_proc=2, verbose=0)
    message = str(caught.value)
    assert caught.value.rank == 1
    assert message.startswith("rank 1 (executor ")
    assert "raised KeyError: 'rank 1 has no shard 7'" in message
    assert "_raises_on_rank_1" in message and "Traceback" in message
    assert caught.value.executor and caught.value.executor in message


def test_elastic_survives_a_lost_executor(spark: Any, tmp_path: Path) -> None:
    """run_elastic: one executor's process (and the Python worker under it) is killed;
    the survivor goes on from its last commit and Spark's retry of the lost task joins."""
    example = _example()
    train_rows, test_rows = _rows(spark, example)
    progress = tmp_path / "progress.log"
    args = example.parser.parse_args(["--epochs", "10", "--batch-sleep", "0.1",
                                      "--batches-per-commit", "4", "--progress", str(progress)])
    outcome: dict[str, Any] = {}

    def drive() -> None:
        try:
            outcome["results"] = hora.spark.run_elastic(
                example.train_elastic, args=(train_rows, test_rows, args), num_proc=2,
                min_num_proc=1, max_num_proc=2, elastic_timeout=120, verbose=0)
        except BaseException as exc:  # handed to the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()

    def wait_line(pattern: str, after: int, timeout: float) -> tuple[int, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and thread.is_alive():
            lines = progress.read_text().splitlines() if progress.exists() else []
            for number, line in enumerate(lines[after:], start=after):
                if pattern in line:
                    return number + 1, line
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} within {timeout:g} s: {outcome!r}\n"
                             + (progress.read_text() if progress.exists() else "(no progress)"))

    at, _ = wait_line("world 2 at", 0, 180)
    executors = {pid: cmd for pid, cmd in _descendants(os.getpid()).items()
                 if "CoarseGrainedExecutorBackend" in cmd}
    assert len(executors) == 2, executors
    victim = max(executors)
    doomed = [victim, *_descendants(victim)]
    killed = time.time()
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    at, line = wait_line("world 1 at", at, 120)
    TIMINGS["Spark elastic recovery (executor killed -> survivor's first commit)"] = (
        float(line.rsplit(" at ", 1)[1]) - killed)
    at, line = wait_line("world 2 at", at, 180)
    TIMINGS["Spark lost task retried -> first commit of 2 again"] = (
        float(line.rsplit(" at ", 1)[1]) - killed)
    thread.join(240)
    assert not thread.is_alive(), "run_elastic did not return"
    assert "error" not in outcome, outcome.get("error")
    results = outcome["results"]
    RESULTS["spark_digits (run_elastic, an executor killed)"] = "; ".join(
        f"rank {r['rank']} on {r.get('host', '?')}: accuracy {r['accuracy']:.4f}, "
        f"parameters {r['params']}" for r in results)
    assert [r["rank"] for r in results] == [0, 1]
    assert len({r["params"] for r in results}) == 1, results
    assert all(r["accuracy"] >= 0.85 for r in results), results
