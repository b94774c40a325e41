"""What runs inside a Spark task: one rank of :func:`hora.spark.run` (or one elastic worker).

Imported by PySpark on the executors; it imports nothing of PySpark at
module level but the task context, and never raises out of the task for the
user's error: the error travels back as the task's result, so that Spark
does not retry a rank that failed on its own.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hora._clusters import dumps, enter_shim, loads

__all__ = ["TaskOutcome", "TaskSpec", "elastic_task", "fixed_task"]


@dataclass(frozen=True)
class TaskSpec:
    """What every task of one job gets from the driver (pickled into the closure)."""

    payload: bytes
    coordinator: str
    job_id: str
    token: str
    env: Mapping[str, str]
    shim: str | None
    start_timeout_s: float
    elastic: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class TaskOutcome:
    """One task's answer: its rank, where it ran, and its result or error.

    ``error`` is ``(type name, message, traceback)``; ``lost`` says the error
    was hora's reaction to another rank's failure (a lost peer), not this
    rank's own; ``refused`` says Spark retried the task and hora would not
    start the rank again.
    """

    rank: int
    partition: int
    executor: str
    pid: int
    result: bytes | None = None
    error: tuple[str, str, str] | None = None
    lost: bool = False
    refused: bool = False


def _placement(addresses: list[str], partition: int) -> tuple[str, int, int, int, int]:
    """This task's host and (local_rank, local_size, cross_rank, cross_size) among the tasks."""
    hosts = [a.rsplit(":", 1)[0] for a in addresses]
    host = hosts[partition]
    same = [i for i, h in enumerate(hosts) if h == host]
    local_rank = same.index(partition)
    # Hosts with a task of this local rank, in order of first appearance.
    order: list[str] = []
    for h in hosts:
        if h not in order:
            order.append(h)
    with_local = [h for h in order if hosts.count(h) > local_rank]
    return host, local_rank, len(same), with_local.index(host), len(with_local)


def _call(spec: TaskSpec) -> Any:
    fn, args, kwargs = loads(spec.payload)
    return fn(*args, **kwargs)


def _outcome(rank: int, partition: int, executor: str, spec: TaskSpec) -> TaskOutcome:
    from hora import _runtime
    from hora.errors import HorovodInternalError

    try:
        value = _call(spec)
    except Exception as exc:
        error = (type(exc).__name__, str(exc), traceback.format_exc())
        # Leave at once, so that the other ranks learn of it now, not at a deadline.
        _runtime.shutdown()
        return TaskOutcome(rank, partition, executor, os.getpid(), error=error,
                           lost=isinstance(exc, HorovodInternalError))
    final = _runtime.current().world.rank if _runtime.is_initialized() else rank
    _runtime.shutdown()
    return TaskOutcome(final, partition, executor, os.getpid(), result=dumps(value))


def fixed_task(spec: TaskSpec) -> Any:
    """The barrier task function of :func:`hora.spark.run` for ``spec``."""

    def task(_: Iterable[Any]) -> Iterator[TaskOutcome]:
        from pyspark import BarrierTaskContext

        from hora.runner.env import worker_environment
        from hora.runner.hosts import SlotInfo

        ctx = BarrierTaskContext.get()
        partition = ctx.partitionId()
        addresses = [info.address for info in ctx.getTaskInfos()]
        executor = addresses[partition]
        if ctx.attemptNumber() > 0:
            # Spark retries a failed barrier stage as a whole; the job's world
            # already formed once, so a second rank `partition` is refused.
            yield TaskOutcome(partition, partition, executor, os.getpid(), refused=True)
            return
        enter_shim(spec.shim)
        host, local_rank, local_size, cross_rank, cross_size = _placement(addresses, partition)
        slot = SlotInfo(hostname=host, rank=partition, size=len(addresses),
                        local_rank=local_rank, local_size=local_size, cross_rank=cross_rank,
                        cross_size=cross_size)
        env = worker_environment({}, slot, coordinator=spec.coordinator, job_id=spec.job_id,
                                 token=spec.token, worker_settings={
                                     # the address that reaches the coordinator
                                     "data_plane_address": "auto",
                                     "start_timeout": timedelta(seconds=spec.start_timeout_s)})
        os.environ.update({**env, **spec.env})
        yield _outcome(partition, partition, executor, spec)

    return task


def elastic_task(spec: TaskSpec) -> Any:
    """The task function of :func:`hora.spark.run_elastic`: an elastic worker per task."""

    def task(_: Iterable[Any]) -> Iterator[TaskOutcome]:
        from pyspark import TaskContext

        from hora.runner.env import elastic_worker_environment

        ctx = TaskContext.get()
        partition = ctx.partitionId() if ctx is not None else -1
        enter_shim(spec.shim)
        settings = {"data_plane_address": "auto",
                    "start_timeout": timedelta(seconds=spec.start_timeout_s),
                    **(spec.elastic or {})}
        size = int(settings.pop("size"))
        env = elastic_worker_environment({}, socket.gethostname(), size=size,
                                         coordinator=spec.coordinator, job_id=spec.job_id,
                                         token=spec.token, worker_settings=settings)
        os.environ.update({**env, **spec.env})
        executor = f"{socket.gethostname()} (task attempt {ctx.attemptNumber() if ctx else 0})"
        yield _outcome(-1, partition, executor, spec)

    return task

