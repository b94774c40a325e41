"""``RayExecutor``: Horovod's Ray API, with hora's coordinator and data plane.

The workers are Ray actors placed by a placement group. Each joins a hora
coordinator through the SDK, as any trainer does, when the user's function
calls ``hvd.init()``: the executor gives every actor the job's variables
(coordinator, job, token, rank and placement) beforehand. The coordinator is
a Ray actor of its own, on the driver's node, unless the settings name one.
Tensors go peer to peer between the actors' nodes; only the user's functions
and their return values travel through Ray.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from hora._clusters import active_shim, dumps, job_identity
from hora.runner.env import worker_environment
from hora.runner.hosts import HostSlots, assign_ranks

from ._actors import CoordinatorActor, WorkerActor, WorkerFailure

__all__ = ["RayExecutor", "RayExecutorError", "RaySettings"]

# After the first failure, how long the others may take to report theirs: a
# dead actor is the cause the user needs, and a survivor's RankLostError may
# come a moment before Ray notices the death.
_NOTICE_S = 2.0
# How long shutdown() waits for the ranks to leave the job before killing them.
_LEAVE_S = 10.0


@dataclass(frozen=True)
class RaySettings:
    """Horovod's ``MiniSettings``: what :meth:`RayExecutor.create_settings` returns.

    Attributes:
        timeout_s: seconds ``start()`` may take to place the workers and gather
            them into one world (Horovod's rendezvous timeout).
        placement_group_timeout_s: seconds to wait for the placement group;
            ``start()`` waits for the smaller of this and ``timeout_s``.
        ssh_identity_file, ssh_str: accepted for Horovod's signature; hora
            never uses ssh on Ray (the workers are actors).
        nics: network interfaces the data plane may use (the first is used).
        verbose: Horovod's verbosity; 0 keeps the driver quiet.
        coordinator: ``HOST:PORT`` of a running coordinator to join instead of
            starting one as a Ray actor; ``token`` is then its job token.
        token: the job token (a random one when None).
    """

    timeout_s: float = 300.0
    placement_group_timeout_s: float = 100.0
    ssh_identity_file: str | None = None
    ssh_str: str | None = None
    nics: frozenset[str] | None = None
    verbose: int = 1
    coordinator: str | None = None
    token: str | None = None


class RayExecutorError(RuntimeError):
    """A rank failed, or the job could not start on the Ray cluster.

    Attributes:
        rank: the failing rank (None when the job did not start).
        node: its Ray node's IP address, when known.
        pid: its actor's process id, when known.
    """

    def __init__(self, message: str, rank: int | None = None, node: str | None = None,
                 pid: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.node = node
        self.pid = pid


@dataclass
class _Rank:
    actor: Any
    node: str
    pid: int
    env: dict[str, str] = field(default_factory=dict)


def _describe(resources: Mapping[str, float]) -> str:
    shown = {k: v for k, v in sorted(resources.items())
             if k in ("CPU", "GPU") or k.startswith("accelerator")}
    return ", ".join(f"{k}={v:g}" for k, v in shown.items()) or "nothing"


def _nodes() -> str:
    """Each alive node's address and resources, for an error message."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    return "; ".join(f"node {n['NodeManagerAddress']} {_describe(n.get('Resources', {}))}"
                     for n in alive) or "no alive node"


def start_coordinator_actor(token: str, deadline: float, timeout_s: float
                            ) -> tuple[Any, str, str]:
    """Starts a coordinator actor on the driver's node.

    Returns:
        The actor, its gRPC address ``HOST:PORT``, and its dashboard's URL.

    Raises:
        RayExecutorError: it did not start before ``deadline``.
    """
    # On the driver's node: the job lives as long as the driver, whichever
    # worker node goes away.
    here = ray.get_runtime_context().get_node_id()
    actor: Any = ray.remote(CoordinatorActor).options(
        num_cpus=0, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote(token)
    try:
        address, http_port = ray.get(actor.address.remote(),
                                     timeout=max(0.1, deadline - time.monotonic()))
    except ray.exceptions.GetTimeoutError as exc:
        ray.kill(actor)
        raise RayExecutorError(f"timed out after {timeout_s:g} s waiting for the coordinator "
                               f"actor to start") from exc
    return actor, str(address), f"http://{address.rsplit(':', 1)[0]}:{http_port}"


def stop_coordinator(actor: Any) -> None:
    """Stops the coordinator actor, then kills it."""
    try:
        ray.get(actor.stop.remote(), timeout=10)
    except Exception:  # noqa: S110 - it is killed next either way
        pass
    ray.kill(actor)


class RayExecutor:
    """Runs functions on ``num_workers`` ranks, each a Ray actor in one hora job.

    Args:
        settings: from :meth:`create_settings`.
        num_workers: number of ranks, packed onto as few nodes as fit.
        num_hosts: instead of ``num_workers``: this many nodes, each running
            ``num_workers_per_host`` ranks.
        num_workers_per_host: ranks per node with ``num_hosts``.
        cpus_per_worker: CPUs Ray reserves for each rank.
        use_gpu: reserve GPUs too.
        gpus_per_worker: GPUs per rank with ``use_gpu`` (default 1).

    Raises:
        ValueError: a combination Horovod refuses too.
    """

    @classmethod
    def create_settings(cls, timeout_s: float = 300, ssh_identity_file: str | None = None,
                        ssh_str: str | None = None, placement_group_timeout_s: float = 100,
                        nics: Sequence[str] | None = None, verbose: int = 1,
                        coordinator: str | None = None, token: str | None = None
                        ) -> RaySettings:
        """Horovod's settings for Ray: ``timeout_s`` bounds ``start()``.

        ``coordinator`` and ``token`` (hora's own) name a running coordinator.
        """
        return RaySettings(timeout_s=float(timeout_s),
                           placement_group_timeout_s=float(placement_group_timeout_s),
                           ssh_identity_file=ssh_identity_file, ssh_str=ssh_str,
                           nics=frozenset(nics) if nics else None, verbose=verbose,
                           coordinator=coordinator, token=token)

    def __init__(self, settings: RaySettings | None = None, num_workers: int | None = None,
                 num_hosts: int | None = None, num_workers_per_host: int = 1,
                 cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: float | None = None, use_current_placement_group: bool = True,
                 min_workers: int | None = None, max_workers: int | None = None,
                 **elastic: Any) -> None:
        if min_workers is not None or max_workers is not None or elastic:
            raise ValueError("elastic arguments (min_workers, max_workers, ...) belong to "
                             "hora.ray.ElasticRayExecutor")
        if gpus_per_worker and not use_gpu:
            raise ValueError("gpus_per_worker is set, but use_gpu is False")
        if num_workers is None and num_hosts is None:
            raise ValueError("give num_workers, or num_hosts and num_workers_per_host")
        if num_workers is not None and num_hosts is not None:
            raise ValueError("give num_workers or num_hosts, not both")
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        if num_hosts is not None and (num_hosts < 1 or num_workers_per_host < 1):
            raise ValueError("num_hosts and num_workers_per_host must be at least 1")
        self.settings = settings or RaySettings()
        self.num_workers = num_workers if num_workers is not None else (
            (num_hosts or 0) * num_workers_per_host)
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self._ranks: list[_Rank] = []
        self._pg: PlacementGroup | None = None
        self._coordinator_actor: Any = None
        self.coordinator_address: str | None = None
        self.dashboard: str | None = None
        self.job_id: str | None = None

    # -- start ------------------------------------------------------------------------

    def _bundles(self) -> tuple[list[dict[str, float]], str, list[int]]:
        """The placement group's bundles, its strategy, and each rank's bundle index."""
        per_worker = {"CPU": float(self.cpus_per_worker)}
        if self.use_gpu:
            per_worker["GPU"] = float(self.gpus_per_worker)
        if self.num_hosts is None:
            return ([dict(per_worker) for _ in range(self.num_workers)], "PACK",
                    list(range(self.num_workers)))
        per_host = {k: v * self.num_workers_per_host for k, v in per_worker.items()}
        return ([dict(per_host) for _ in range(self.num_hosts)], "STRICT_SPREAD",
                [i // self.num_workers_per_host for i in range(self.num_workers)])

    def _check_fits(self) -> str:
        """Fails at once when the whole cluster has less than the job asks for.

        Returns:
            What the job asks for, in words.
        """
        bundles, strategy, _ = self._bundles()
        asked = {k: sum(b.get(k, 0) for b in bundles) for k in bundles[0]}
        what = (f"{len(bundles)} bundles of {_describe(bundles[0])} ({strategy}) for "
                f"{self.num_workers} workers")
        total = ray.cluster_resources()
        if any(total.get(k, 0) < v for k, v in asked.items()):
            raise RayExecutorError(f"the Ray cluster cannot run this job: asked for {what}; "
                                   f"the cluster has {_describe(total)} in all: {_nodes()}")
        return what

    def _place(self, what: str, deadline: float) -> list[int]:
        bundles, strategy, index = self._bundles()
        self._pg = placement_group(bundles, strategy=strategy)
        wait = min(self.settings.placement_group_timeout_s, max(0.0, deadline - time.monotonic()))
        ready, _ = ray.wait([self._pg.ready()], timeout=wait)
        if not ready:
            raise RayExecutorError(
                f"the Ray cluster did not place the workers within timeout_s="
                f"{self.settings.timeout_s:g} s: asked for {what}; the cluster has "
                f"{_describe(ray.available_resources())} free: {_nodes()}")
        return index

    def _start_coordinator(self, token: str, deadline: float) -> str:
        if self.settings.coordinator:
            return self.settings.coordinator
        self._coordinator_actor, address, self.dashboard = start_coordinator_actor(
            token, deadline, self.settings.timeout_s)
        return address

    def _get(self, refs: Any, deadline: float, what: str) -> Any:
        try:
            return ray.get(refs, timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError as exc:
            raise RayExecutorError(f"timed out after {self.settings.timeout_s:g} s waiting for "
                                   f"{what}") from exc

    def start(self, executable_cls: type | None = None,
              executable_args: Sequence[Any] | None = None,
              executable_kwargs: Mapping[str, Any] | None = None,
              extra_env_vars: Mapping[str, str] | None = None) -> None:
        """Places the workers, starts the coordinator, and gives every rank its place.

        Raises:
            RayExecutorError: the cluster lacks the resources asked for, or the
                workers were not placed within ``timeout_s``; the message says
                what was asked for and what the cluster has.
        """
        if not ray.is_initialized():
            ray.init()
        deadline = time.monotonic() + self.settings.timeout_s
        try:
            self._start(deadline, executable_cls, executable_args, executable_kwargs,
                        extra_env_vars)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, deadline: float, executable_cls: type | None,
               executable_args: Sequence[Any] | None,
               executable_kwargs: Mapping[str, Any] | None,
               extra_env_vars: Mapping[str, str] | None) -> None:
        what = self._check_fits()
        self.job_id, token = job_identity(self.settings.token)
        coordinator = self._start_coordinator(token, deadline)
        bundle_of = self._place(what, deadline)
        shim = active_shim()
        assert self._pg is not None
        actors = []
        for index in bundle_of:
            options: dict[str, Any] = {
                "num_cpus": self.cpus_per_worker,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=index)}
            if self.use_gpu:
                options["num_gpus"] = self.gpus_per_worker
            actor: Any = ray.remote(WorkerActor).options(**options).remote(shim)
            actors.append(actor)
        where = self._get([a.where.remote() for a in actors], deadline, "the workers to start")
        self._ranks = self._order(actors, where)
        settings: dict[str, Any] = {"start_timeout": timedelta(seconds=self.settings.timeout_s)}
        if self.settings.nics:
            settings["network_interface"] = sorted(self.settings.nics)[0]
        slots = assign_ranks(self._hosts(), len(self._ranks))
        for slot, rank in zip(slots, self._ranks, strict=True):
            rank.env = worker_environment(
                {}, slot, coordinator=coordinator, job_id=self.job_id, token=token,
                worker_settings={**settings, "data_plane_address": rank.node})
            rank.env.update(extra_env_vars or {})
        payload = None if executable_cls is None else dumps(
            (executable_cls, tuple(executable_args or ()), dict(executable_kwargs or {})))
        self._get([r.actor.set_env.remote(r.env) for r in self._ranks], deadline,
                  "the workers to take their environment")
        self._get([r.actor.start_executable.remote(payload) for r in self._ranks], deadline,
                  "executable_cls to start on every worker")
        self.coordinator_address = coordinator
        if self.settings.verbose:
            placed = ", ".join(f"rank {i}: {r.node} pid {r.pid}" for i, r in enumerate(self._ranks))
            print(f"hora.ray: job {self.job_id}, coordinator {coordinator}; {placed}", flush=True)

    @staticmethod
    def _order(actors: Sequence[Any], where: Sequence[tuple[str, int]]) -> list[_Rank]:
        """Ranks grouped by node, nodes in order of their first actor: a node's ranks are
        consecutive, as ``horovodrun -H`` places them."""
        first: dict[str, int] = {}
        for i, (node, _) in enumerate(where):
            first.setdefault(node, i)
        order = sorted(range(len(actors)), key=lambda i: (first[where[i][0]], i))
        return [_Rank(actors[i], where[i][0], where[i][1]) for i in order]

    def _hosts(self) -> list[HostSlots]:
        counts: dict[str, int] = {}
        for rank in self._ranks:
            counts[rank.node] = counts.get(rank.node, 0) + 1
        return [HostSlots(node, n) for node, n in counts.items()]

    # -- run ----------------------------------------------------------------------------

    def _require_started(self) -> None:
        if not self._ranks:
            raise RayExecutorError("the executor is not started; call start() first")

    def run_remote(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
                   kwargs: Mapping[str, Any] | None = None) -> list[Any]:
        """Starts ``fn(*args, **kwargs)`` on every rank; the ObjectRefs, in rank order."""
        self._require_started()
        payload = dumps((fn, tuple(args or ()), dict(kwargs or {})))
        return [r.actor.execute.remote(payload, False) for r in self._ranks]

    def run(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
            kwargs: Mapping[str, Any] | None = None) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank; each rank's result, in rank order.

        Raises:
            RayExecutorError: a rank raised (its traceback is in the message) or
                its actor died (its node and the cause are).
        """
        return self._gather(self.run_remote(fn, args, kwargs))

    def execute(self, fn: Callable[[Any], Any]) -> list[Any]:
        """Runs ``fn(executable)`` on every rank (``executable_cls``'s instance, or None)."""
        self._require_started()
        payload = dumps((fn, (), {}))
        return self._gather([r.actor.execute.remote(payload, True) for r in self._ranks])

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Runs ``fn(executable)`` on rank 0 only; its result."""
        self._require_started()
        payload = dumps((fn, (), {}))
        return self._gather([self._ranks[0].actor.execute.remote(payload, True)])[0]

    def _gather(self, refs: list[Any]) -> list[Any]:
        rank_of = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        failures: dict[int, BaseException] = {}
        noticed: float | None = None
        while pending:
            timeout = None if noticed is None else max(0.0, noticed + _NOTICE_S - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not done:
                break
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as exc:
                    failures[rank_of[ref]] = exc
                    noticed = noticed if noticed is not None else time.monotonic()
        if failures:
            raise self._failure(failures)
        return list(ray.get(refs))

    def _failure(self, failures: Mapping[int, BaseException]) -> RayExecutorError:
        # A dead actor is the cause; the others' errors are its consequence.
        deaths = [r for r, e in failures.items() if isinstance(e, ray.exceptions.RayActorError)]
        rank = min(deaths) if deaths else min(failures)
        exc = failures[rank]
        where = self._ranks[rank]
        if deaths:
            cause = str(exc).strip().splitlines()
            why = (f"died (its Ray actor is gone: "
                   f"{' '.join(cause[:2]) if cause else type(exc).__name__})")
        else:
            inner = getattr(exc, "cause", None)
            why = f"raised {inner}" if isinstance(inner, WorkerFailure) else f"failed: {exc}"
        others = sorted(set(failures) - {rank})
        tail = f" (ranks {others} failed after it)" if others else ""
        return RayExecutorError(f"rank {rank} (node {where.node}, actor pid {where.pid}) {why}"
                                f"{tail}", rank=rank, node=where.node, pid=where.pid)

    # -- stop ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stops the workers and the coordinator and frees the placement group."""
        # Each rank leaves the job first, so that none reports a lost coordinator.
        leaving = [r.actor.leave.remote() for r in self._ranks]
        if leaving:
            ray.wait(leaving, num_returns=len(leaving), timeout=_LEAVE_S)
        for rank in self._ranks:
            ray.kill(rank.actor)
        self._ranks = []
        if self._coordinator_actor is not None:
            stop_coordinator(self._coordinator_actor)
            self._coordinator_actor = None
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
