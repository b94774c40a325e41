"""``hora.spark.run`` and ``run_elastic``: Horovod's Spark API on hora.

The driver starts a hora coordinator (embedded, in this process) on the
address the executors reach it by (``spark.driver.host``) and runs one Spark
task per rank on the active ``SparkSession``'s cluster: in barrier execution
mode for a fixed world, so that every rank runs at once; as ordinary tasks
for an elastic one, whose members the coordinator ranks, so that a task
Spark retries after losing its executor joins the next generation. Tensors
go peer to peer between the executors, never through Spark.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora._clusters import active_shim, dumps, job_identity, loads
from hora.runner.embedded import start_embedded_coordinator

from ._task import TaskOutcome, TaskSpec, elastic_task, fixed_task

__all__ = ["SparkRunError", "run", "run_elastic"]

# Horovod's default for HOROVOD_SPARK_START_TIMEOUT.
_DEFAULT_START_TIMEOUT_S = 600.0


class SparkRunError(RuntimeError):
    """A rank of a Spark job failed, or the Spark job did.

    Attributes:
        rank: the failing rank (None when no rank said why).
        executor: the executor (``host:port``) it ran on, when known.
    """

    def __init__(self, message: str, rank: int | None = None,
                 executor: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.executor = executor


def _context() -> Any:
    try:
        from pyspark import SparkContext
        from pyspark.sql import SparkSession
    except ImportError as exc:
        raise ImportError("hora.spark needs PySpark: pip install 'hora[spark]'") from exc
    session = SparkSession.getActiveSession()
    if session is not None:
        return session.sparkContext
    # The active session is per thread; the process's SparkContext is the same cluster.
    context = SparkContext._active_spark_context
    if context is None:
        raise RuntimeError("hora.spark.run needs an active SparkSession; create one first "
                           "(SparkSession.builder...getOrCreate())")
    return context


def _start(sc: Any, token: str) -> Any:
    host = sc.getConf().get("spark.driver.host", "127.0.0.1")
    return start_embedded_coordinator(host, token)


def _spec(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any] | None,
          coordinator: str, job_id: str, token: str, env: Mapping[str, str] | None,
          start_timeout: float | None, elastic: Mapping[str, Any] | None = None) -> TaskSpec:
    return TaskSpec(payload=dumps((fn, tuple(args), dict(kwargs or {}))),
                    coordinator=coordinator, job_id=job_id, token=token,
                    env=dict(env or {}), shim=active_shim(),
                    start_timeout_s=float(start_timeout or _DEFAULT_START_TIMEOUT_S),
                    elastic=elastic)


def _failure(outcomes: Sequence[TaskOutcome]) -> SparkRunError | None:
    failed = [o for o in outcomes if o.error is not None]
    # A rank's own error first; the others' lost-peer errors are its consequence.
    own = [o for o in failed if not o.lost] or failed
    if own:
        first = min(own, key=lambda o: o.rank)
        assert first.error is not None
        kind, message, trace = first.error
        others = sorted(o.rank for o in failed if o is not first)
        tail = f"\n(ranks {others} failed after it)" if others else ""
        return SparkRunError(f"rank {first.rank} (executor {first.executor}, pid {first.pid}) "
                             f"raised {kind}: {message}\n{trace}{tail}", first.rank,
                             first.executor)
    refused = sorted(o.rank for o in outcomes if o.refused)
    if refused:
        return SparkRunError(
            f"Spark retried the barrier stage after a failure of its first attempt (a lost "
            f"executor: see Spark's log); hora does not start ranks {refused} again into a "
            f"job whose world already formed")
    return None


def _collect(rdd: Any, what: str) -> list[TaskOutcome]:
    try:
        return list(rdd.collect())
    except Exception as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()][:6]
        raise SparkRunError(f"the Spark job of {what} failed: " + "\n".join(lines)) from exc


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
        num_proc: int | None = None, start_timeout: float | None = None,
        env: Mapping[str, str] | None = None, stdout: Any = None, stderr: Any = None,
        verbose: int = 1, prefix_output_with_timestamp: bool = False,
        executable: str | None = None) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``num_proc`` Spark tasks; each rank's result in order.

    Horovod's ``horovod.spark.run``. ``fn`` calls ``hvd.init()`` itself.

    Args:
        fn: the function (pickled with cloudpickle).
        args, kwargs: its arguments.
        num_proc: ranks, one barrier task each (default: the default parallelism).
        start_timeout: seconds the ranks may take to gather (default 600).
        env: variables set in every task before ``fn`` runs.
        stdout, stderr: accepted for Horovod's signature; the tasks' output
            stays in the executors' logs, where Spark keeps it.
        verbose: 0 keeps the driver quiet.
        prefix_output_with_timestamp, executable: accepted for Horovod's
            signature.

    Returns:
        ``[rank 0's return value, rank 1's, ...]``.

    Raises:
        SparkRunError: a rank raised (its rank, executor and traceback are in
            the message), or the Spark job failed.
    """
    sc = _context()
    num_proc = int(num_proc or sc.defaultParallelism)
    if num_proc < 1:
        raise ValueError(f"num_proc must be at least 1, got {num_proc}")
    job_id, token = job_identity(None)
    coordinator = _start(sc, token)
    try:
        spec = _spec(fn, args, kwargs, coordinator.grpc_address, job_id, token, env,
                     start_timeout)
        if verbose:
            print(f"hora.spark: job {job_id}, coordinator {coordinator.grpc_address}, "
                  f"{num_proc} barrier tasks", file=sys.stderr, flush=True)
        rdd = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(
            fixed_task(spec))
        outcomes = _collect(rdd, f"hora job {job_id}")
    finally:
        coordinator.stop()
    return _results(outcomes)


def _results(outcomes: list[TaskOutcome]) -> list[Any]:
    """Every rank's return value in rank order, or the first failure raised."""
    failure = _failure(outcomes)
    if failure is not None:
        raise failure
    ordered = sorted(outcomes, key=lambda o: o.rank)
    return [loads(o.result) for o in ordered if o.result is not None]


def run_elastic(fn: Callable[..., Any], args: Sequence[Any] = (),
                kwargs: Mapping[str, Any] | None = None, num_proc: int | None = None,
                min_num_proc: int | None = None, max_num_proc: int | None = None,
                start_timeout: float | None = None, elastic_timeout: float | None = None,
                reset_limit: int | None = None, env: Mapping[str, str] | None = None,
                stdout: Any = None, stderr: Any = None, verbose: int = 1,
                prefix_output_with_timestamp: bool = False) -> list[Any]:
    """Runs an elastic ``fn`` on Spark tasks; a lost executor makes a new generation.

    Horovod's ``horovod.spark.run_elastic``: ``fn`` uses ``hvd.elastic.run``.
    Each task is an elastic worker; when Spark loses an executor its
    survivors restore the last commit and go on, and the task Spark starts
    again elsewhere joins at the next commit.

    Args:
        num_proc: tasks to start (default: the default parallelism).
        min_num_proc: fewest workers to train with (default ``num_proc``).
        max_num_proc: most workers (default ``num_proc``).
        elastic_timeout: seconds the job may stay below ``min_num_proc``
            (default 600).
        reset_limit: resets a worker may go through (None: no limit).
        Others as for :func:`run`.

    Returns:
        The results of the workers of the final world, in rank order.

    Raises:
        SparkRunError: a worker raised, or the Spark job failed.
    """
    sc = _context()
    num_proc = int(num_proc or sc.defaultParallelism)
    min_np = int(min_num_proc or num_proc)
    max_np = int(max_num_proc or num_proc)
    if not 1 <= min_np <= max_np:
        raise ValueError(f"need 1 <= min_num_proc <= max_num_proc, got {min_np} and {max_np}")
    from datetime import timedelta

    elastic: dict[str, Any] = {"size": num_proc, "min_size": min_np, "max_size": max_np}
    if elastic_timeout:  # else the settings' default (hora_proto.options)
        elastic["elastic_timeout"] = timedelta(seconds=elastic_timeout)
    if reset_limit is not None:
        elastic["reset_limit"] = reset_limit
    job_id, token = job_identity(None)
    coordinator = _start(sc, token)
    try:
        spec = _spec(fn, args, kwargs, coordinator.grpc_address, job_id, token, env,
                     start_timeout, elastic)
        if verbose:
            print(f"hora.spark: elastic job {job_id}, coordinator {coordinator.grpc_address}, "
                  f"{num_proc} tasks ({min_np}..{max_np} workers)", file=sys.stderr, flush=True)
        rdd = sc.parallelize(range(num_proc), num_proc).mapPartitions(elastic_task(spec))
        outcomes = _collect(rdd, f"hora elastic job {job_id}")
    finally:
        coordinator.stop()
    return _results(outcomes)
