"""``ElasticRayExecutor``: Horovod's elastic Ray API on hora's elastic path.

Discovery reads the Ray cluster's alive nodes: each offers
``CPU // cpus_per_slot`` slots (fewer with GPUs). The decisions are those
of an elastic ``horarun`` (:class:`hora.runner.elastic.ElasticPlanner`):
a worker per free slot up to ``max_workers``; a worker that dies
blacklists its node, and the survivors, told by the coordinator, restore
their last commit and go on in a new generation; a node that joins gets
workers, which join at the next commit. The executor carries the decisions
out with Ray actors pinned to their nodes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hora._clusters import active_shim, dumps, job_identity
from hora.runner.elastic import (
    ElasticPlanner,
    ElasticPolicy,
    Finish,
    ReportEvent,
    Say,
    StartWorker,
    StopWorker,
)
from hora.runner.env import elastic_worker_environment
from hora.runner.hosts import HostSlots
from hora_proto.options import BY_FIELD

from ._actors import WorkerActor, WorkerFailure
from .executor import RayExecutorError, RaySettings, start_coordinator_actor, stop_coordinator

__all__ = ["ElasticRayExecutor", "ElasticRaySettings"]

# Horovod's API takes seconds; the default is the option's (hora_proto.options).
_ELASTIC_TIMEOUT_S = BY_FIELD["elastic_timeout"].default.total_seconds()

# How often the driver looks at the workers, and at the cluster's nodes.
_POLL_S = 0.2
_DISCOVERY_S = 1.0


@dataclass(frozen=True)
class ElasticRaySettings(RaySettings):
    """Horovod's ``ElasticSettings`` for Ray (:meth:`ElasticRayExecutor.create_settings`).

    Attributes:
        min_np: fewest workers the job runs with.
        max_np: most workers (None: every slot the cluster offers).
        elastic_timeout: seconds the job may stay below ``min_np``.
        reset_limit: resets a worker may go through (None: no limit).
    """

    min_np: int = 1
    max_np: int | None = None
    elastic_timeout: float = _ELASTIC_TIMEOUT_S
    reset_limit: int | None = None


@dataclass
class _Worker:
    actor: Any
    node: str
    ref: Any = None
    pid: int = 0


class ElasticRayExecutor:
    """Runs one elastic function on every slot the Ray cluster offers.

    Args:
        settings: from :meth:`create_settings`.
        use_gpu: a slot needs a GPU too.
        cpus_per_slot: CPUs per worker.
        gpus_per_slot: GPUs per worker with ``use_gpu`` (default 1).
        env_vars: variables set on every worker before the function runs.
        override_discovery: accepted for Horovod's signature; discovery
            always reads the Ray cluster.
        min_workers, max_workers: override the settings' ``min_np``/``max_np``.
    """

    @staticmethod
    def create_settings(min_np: int = 1, max_np: int | None = None,
                        reset_limit: int | None = None,
                        elastic_timeout: float = _ELASTIC_TIMEOUT_S,
                        timeout_s: float = 30, ssh_identity_file: str | None = None,
                        nics: Sequence[str] | None = None, verbose: int = 1,
                        coordinator: str | None = None, token: str | None = None,
                        **ignored: Any) -> ElasticRaySettings:
        """Horovod's elastic settings; ``timeout_s`` bounds the start of each worker."""
        return ElasticRaySettings(timeout_s=float(timeout_s), min_np=min_np, max_np=max_np,
                                  reset_limit=reset_limit, elastic_timeout=float(elastic_timeout),
                                  ssh_identity_file=ssh_identity_file,
                                  nics=frozenset(nics) if nics else None, verbose=verbose,
                                  coordinator=coordinator, token=token)

    def __init__(self, settings: RaySettings | None = None, use_gpu: bool = False,
                 cpus_per_slot: float = 1, gpus_per_slot: float | None = None,
                 env_vars: dict[str, str] | None = None, override_discovery: bool = True,
                 min_workers: int | None = None, max_workers: int | None = None) -> None:
        if gpus_per_slot and not use_gpu:
            raise ValueError("gpus_per_slot is set, but use_gpu is False")
        base = settings if isinstance(settings, ElasticRaySettings) else (
            ElasticRaySettings(**vars(settings)) if settings is not None
            else ElasticRaySettings())
        self.settings = base
        self.min_workers = min_workers if min_workers is not None else base.min_np
        self.max_workers = max_workers if max_workers is not None else base.max_np
        if self.min_workers < 1:
            raise ValueError(f"min_workers must be at least 1, got {self.min_workers}")
        if self.max_workers is not None and self.max_workers < self.min_workers:
            raise ValueError(f"max_workers {self.max_workers} is below min_workers "
                             f"{self.min_workers}")
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = (gpus_per_slot or 1) if use_gpu else 0
        self.env_vars = dict(env_vars or {})
        self._coordinator_actor: Any = None
        self.coordinator_address: str | None = None
        self.job_id: str | None = None
        self._token = ""
        self._workers: dict[int, _Worker] = {}
        self.messages: list[str] = []

    def start(self) -> None:
        """Starts the coordinator (workers start in :meth:`run`, as slots allow)."""
        if not ray.is_initialized():
            ray.init()
        deadline = time.monotonic() + self.settings.timeout_s
        self.job_id, self._token = job_identity(self.settings.token)
        if self.settings.coordinator:
            self.coordinator_address = self.settings.coordinator
        else:
            self._coordinator_actor, self.coordinator_address, _ = start_coordinator_actor(
                self._token, deadline, self.settings.timeout_s)

    def _discover(self) -> list[HostSlots]:
        hosts = []
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            resources = node.get("Resources", {})
            slots = int(resources.get("CPU", 0) // self.cpus_per_slot)
            if self.use_gpu:
                slots = min(slots, int(resources.get("GPU", 0) // self.gpus_per_slot))
            hosts.append(HostSlots(node["NodeManagerAddress"], slots))
        return hosts

    def _node_id(self, address: str) -> str | None:
        for node in ray.nodes():
            if node.get("Alive") and node["NodeManagerAddress"] == address:
                return str(node["NodeID"])
        return None

    def _say(self, message: str) -> None:
        self.messages.append(message)
        if self.settings.verbose:
            print(f"hora.ray: {message}", flush=True)

    def run(self, worker_fn: Callable[[], Any],
            callbacks: Sequence[Callable[[Any], None]] | None = None) -> list[Any]:
        """Runs ``worker_fn()`` on the workers until training finishes.

        Args:
            worker_fn: the training function (it calls ``hvd.init()`` and runs an
                ``hvd.elastic.run`` loop).
            callbacks: accepted for Horovod's signature; not called.

        Returns:
            The results of the workers of the final world, in rank order.

        Raises:
            RayExecutorError: the job could not keep ``min_workers`` workers for
                ``elastic_timeout``, or a worker failed after training finished;
                the message quotes the last failure.
        """
        if self.coordinator_address is None:
            raise RayExecutorError("the executor is not started; call start() first")
        payload = dumps((worker_fn, (), {}))
        planner = ElasticPlanner(ElasticPolicy(
            num_proc=self.max_workers or 1_000_000, min_np=self.min_workers,
            max_np=self.max_workers,
            elastic_timeout=timedelta(seconds=self.settings.elastic_timeout)))
        shim = active_shim()
        results: dict[int, tuple[int, Any]] = {}
        size = 0
        last_discovery = 0.0
        try:
            while True:
                actions: list[Any] = []
                if time.monotonic() - last_discovery >= _DISCOVERY_S:
                    last_discovery = time.monotonic()
                    actions += planner.hosts_discovered(self._discover())
                actions += planner.tick()
                starts = [a for a in actions if isinstance(a, StartWorker)]
                size = size or len(starts)
                for action in actions:
                    if isinstance(action, Say):
                        self._say(action.message)
                    elif isinstance(action, ReportEvent):
                        pass  # said already, through Say
                    elif isinstance(action, StopWorker):
                        worker = self._workers.get(action.worker_id)
                        if worker is not None:
                            ray.kill(worker.actor)
                    elif isinstance(action, Finish):
                        return self._finish(action.code, results)
                for action in starts:
                    failure = self._start_worker(action, payload, shim, size)
                    if failure:
                        for later in planner.worker_start_failed(action.worker_id, 1, failure):
                            if isinstance(later, Say):
                                self._say(later.message)
                            if isinstance(later, Finish):
                                return self._finish(later.code, results)
                    else:
                        planner.worker_running(action.worker_id,
                                               self._workers[action.worker_id].pid)
                for finished in self._reap(planner, results):
                    if isinstance(finished, Say):
                        self._say(finished.message)
                    elif isinstance(finished, Finish):
                        return self._finish(finished.code, results)
                time.sleep(_POLL_S)
        finally:
            self._stop_workers()

    def _start_worker(self, action: StartWorker, payload: bytes, shim: str | None,
                      size: int) -> str:
        """Starts an actor on the action's node and the function on it; '' or why not."""
        node_id = self._node_id(action.host)
        if node_id is None:
            return f"node {action.host} is no longer alive"
        options: dict[str, Any] = {
            "num_cpus": self.cpus_per_slot, "max_restarts": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}
        if self.use_gpu:
            options["num_gpus"] = self.gpus_per_slot
        actor: Any = ray.remote(WorkerActor).options(**options).remote(shim)
        settings: dict[str, Any] = {
            "data_plane_address": action.host, "min_size": self.min_workers,
            "elastic_timeout": timedelta(seconds=self.settings.elastic_timeout),
            "start_timeout": timedelta(seconds=self.settings.timeout_s)}
        if self.max_workers is not None:
            settings["max_size"] = self.max_workers
        if self.settings.reset_limit is not None:
            settings["reset_limit"] = self.settings.reset_limit
        assert self.coordinator_address is not None and self.job_id is not None
        env = elastic_worker_environment(
            {}, action.host, size=max(size, self.min_workers),
            coordinator=self.coordinator_address, job_id=self.job_id, token=self._token,
            worker_settings=settings)
        env.update(self.env_vars)
        worker = _Worker(actor, action.host)
        self._workers[action.worker_id] = worker
        try:
            _, worker.pid = ray.get(actor.where.remote(), timeout=self.settings.timeout_s)
        except Exception as exc:
            ray.kill(actor)
            del self._workers[action.worker_id]
            return f"its actor did not start within {self.settings.timeout_s:g} s: {exc}"
        actor.set_env.remote(env)
        worker.ref = actor.execute_elastic.remote(payload)
        if action.announce or self.settings.verbose > 1:
            self._say(f"started a worker on {action.host} (actor pid {worker.pid})")
        return ""

    def _reap(self, planner: ElasticPlanner, results: dict[int, tuple[int, Any]]) -> list[Any]:
        refs = {w.ref: wid for wid, w in self._workers.items() if w.ref is not None}
        if not refs:
            return []
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        actions: list[Any] = []
        for ref in done:
            wid = refs[ref]
            worker = self._workers[wid]
            worker.ref = None
            try:
                results[wid] = ray.get(ref)
                actions += planner.worker_exited(wid, 0)
            except ray.exceptions.RayActorError as exc:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                actions += planner.worker_exited(wid, -9, error=f"its Ray actor died: {first}")
            except Exception as exc:
                inner = getattr(exc, "cause", None)
                error = (f"{inner.kind}: {inner.message}" if isinstance(inner, WorkerFailure)
                         else str(exc))
                self.messages.append(f"worker on {worker.node} (pid {worker.pid}) raised "
                                     f"{inner if inner is not None else exc}")
                actions += planner.worker_exited(wid, 1, error=error)
        return actions

    def _finish(self, code: int, results: dict[int, tuple[int, Any]]) -> list[Any]:
        if code != 0:
            said = "\n".join(self.messages[-8:])
            raise RayExecutorError(f"the elastic job failed (code {code}):\n{said}")
        ordered = sorted(results.values(), key=lambda item: item[0])
        return [value for _, value in ordered]

    def _stop_workers(self) -> None:
        for worker in self._workers.values():
            ray.kill(worker.actor)
        self._workers.clear()

    def shutdown(self) -> None:
        """Stops the workers and the coordinator."""
        self._stop_workers()
        if self._coordinator_actor is not None:
            stop_coordinator(self._coordinator_actor)
            self._coordinator_actor = None
