"""The background engine of one worker and one generation.

Flow of a tensor (see DESIGN.md, "The flow of one gradient"):

1. A caller thread :meth:`Engine.enqueue` s an :class:`Entry`; its request
   goes to the coordinator over the negotiation stream.
2. The reader thread receives ordered response lists and events. Responses
   go to the executor queue; events (a lost rank, a failed job, a stall)
   are handled at once, so that waiting callers learn of a dead peer even
   while the executor is stuck in a collective.
3. The executor thread runs each response on the data plane in the order
   the coordinator gave, packs fused allreduces into a reused buffer, and
   completes the entries' handles.

A failure of the generation (lost rank, broken stream, data-plane error)
fails every pending handle and every later enqueue with the same error.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hora_native import BackendError, ReduceKind, backend_for_device, create_backend
from hora_proto.v1 import negotiation_pb2, rendezvous_pb2

from ._cache import ResponseCache, Signature
from ._client import CoordinatorClient, NegotiationStream
from ._ops import OpType, ReduceOp, dtype_name, split_rows
from ._shm import segment_prefix
from ._store import CoordinatorStore
from .autotune import Autotuner
from .errors import (
    CoordinatorError,
    HoraError,
    HorovodInternalError,
    InvalidCallError,
    RankLostError,
    TensorMismatchError,
)
from .settings import Settings
from .timeline import NULL_TIMELINE, NullTimeline, Timeline

if TYPE_CHECKING:
    from hora_native.control import ControlMesh

__all__ = ["Engine", "Entry", "Handle"]

log = logging.getLogger("hora")

_NATIVE_REDUCE = {
    ReduceOp.SUM: ReduceKind.SUM,
    ReduceOp.AVERAGE: ReduceKind.SUM,
    ReduceOp.MIN: ReduceKind.MIN,
    ReduceOp.MAX: ReduceKind.MAX,
    ReduceOp.PRODUCT: ReduceKind.PRODUCT,
}

# Control-vector entries only rank 0 sets; the others send this, the MIN's identity.
_UNSET = torch.iinfo(torch.int64).max

_RESPONSE_OP = {
    negotiation_pb2.RESPONSE_TYPE_ALLREDUCE: OpType.ALLREDUCE,
    negotiation_pb2.RESPONSE_TYPE_ALLGATHER: OpType.ALLGATHER,
    negotiation_pb2.RESPONSE_TYPE_BROADCAST: OpType.BROADCAST,
    negotiation_pb2.RESPONSE_TYPE_ALLTOALL: OpType.ALLTOALL,
    negotiation_pb2.RESPONSE_TYPE_REDUCESCATTER: OpType.REDUCESCATTER,
    negotiation_pb2.RESPONSE_TYPE_BARRIER: OpType.BARRIER,
}


# Guards the hand-over between a handle's completion and a thread starting to block on it.
_HANDLE_LOCK = threading.Lock()


class Handle:
    """The future of one enqueued collective."""

    __slots__ = ("name", "_finished", "_event", "_result", "_error", "driver")

    def __init__(self, name: str) -> None:
        self.name = name
        self._finished = False
        # Made only when a thread blocks on this handle: most handles are
        # completed by the round their waiter runs, and an Event per tensor
        # costs more than the rest of its bookkeeping.
        self._event: threading.Event | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        # Set by the engine for tensors its rounds run: a waiting caller runs
        # the rounds itself (until the deadline, a monotonic time) instead of
        # handing them to a thread and back.
        self.driver: Callable[[Handle, float | None], None] | None = None

    def done(self) -> bool:
        return self._finished

    def _complete(self) -> None:
        with _HANDLE_LOCK:
            self._finished = True
            event = self._event
        if event is not None:
            event.set()

    def set_result(self, result: Any) -> None:
        self._result = result
        self._complete()

    def set_error(self, error: BaseException) -> None:
        if not self._finished:
            self._error = error
            self._complete()

    def wait(self, timeout: float | None = None) -> Any:
        """Returns the result, or raises the collective's error.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
        """
        if self.driver is not None and not self._finished:
            deadline = None if timeout is None else time.monotonic() + timeout
            self.driver(self, deadline)
            if deadline is not None:
                timeout = max(0.0, deadline - time.monotonic())
        if not self._finished:
            with _HANDLE_LOCK:
                if not self._finished and self._event is None:
                    self._event = threading.Event()
                event = self._event
            if event is not None and not event.wait(timeout):
                raise TimeoutError(f"tensor {self.name!r} did not complete within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result


@dataclasses.dataclass(eq=False)
class Entry:
    """One collective as the engine sees it.

    ``buffer`` is what the collective reads (and, for in-place reductions and
    broadcasts, writes); ``result`` turns what the collective produced into
    what the caller's handle returns.
    """

    name: str
    op_type: OpType
    buffer: torch.Tensor
    handle: Handle
    reduce_op: ReduceOp = ReduceOp.SUM
    root_rank: int = 0
    prescale_factor: float = 1.0
    postscale_factor: float = 1.0
    process_set_id: int = 0
    splits: Sequence[int] | None = None
    group_id: int = 0
    group_size: int = 0
    result: Callable[[Any], Any] | None = None
    # Why this rank's call is invalid (see TensorRequest.invalid); the
    # coordinator fails the call on every rank, and it never runs.
    invalid: str = ""
    enqueued_at: float = dataclasses.field(default_factory=time.monotonic)
    stall_warned: bool = False

    def signature(self) -> Signature:
        return Signature(dtype_name(self.buffer.dtype), tuple(self.buffer.shape),
                         self.buffer.device.type, int(self.reduce_op),
                         self.prescale_factor, self.postscale_factor)

    def cacheable(self) -> bool:
        """Global-set, ungrouped allreduces can skip the coordinator once negotiated."""
        return (self.op_type == OpType.ALLREDUCE and self.process_set_id == 0
                and self.group_id == 0)

    def request(self) -> negotiation_pb2.TensorRequest:
        return negotiation_pb2.TensorRequest(
            name=self.name, op_type=int(self.op_type), dtype=dtype_name(self.buffer.dtype),
            shape=list(self.buffer.shape), device=self.buffer.device.type,
            reduce_op=int(self.reduce_op), root_rank=self.root_rank,
            prescale_factor=self.prescale_factor, postscale_factor=self.postscale_factor,
            process_set_id=self.process_set_id, splits=list(self.splits or ()),
            group_id=self.group_id, group_size=self.group_size, invalid=self.invalid)


# Element types the control mesh reduces itself (see Engine._run_mesh), by wire name.
_MESH_DTYPE_NAMES = frozenset({"float16", "bfloat16", "float32", "float64", "uint8", "int8",
                               "int16", "int32", "int64"})

# In-place reductions the engine applies to contributions it received itself.
_REDUCE_INTO: dict[ReduceOp, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    ReduceOp.SUM: torch.Tensor.add_,
    ReduceOp.AVERAGE: torch.Tensor.add_,
    ReduceOp.MIN: lambda acc, other: torch.minimum(acc, other, out=acc),
    ReduceOp.MAX: lambda acc, other: torch.maximum(acc, other, out=acc),
    ReduceOp.PRODUCT: torch.Tensor.mul_,
}


def _post_factor(entry: Entry, set_size: int) -> float:
    """What a reduction's result is multiplied by: the postscale, over the set size
    for an average."""
    post = entry.postscale_factor
    return post / set_size if entry.reduce_op == ReduceOp.AVERAGE else post


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dim() == 1 else tensor.view(-1)


def _unpack(entries: list[Entry], fused: torch.Tensor) -> None:
    """Copies a fused result back into the entries' buffers, in order."""
    outputs = [_flat(entry.buffer) for entry in entries]
    torch._foreach_copy_(outputs, list(fused.split([out.numel() for out in outputs])))


def _scale(tensor: torch.Tensor, factor: float) -> None:
    if factor == 1.0:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.mul_(factor)
    else:
        # Integers: scale in double precision and truncate toward zero, as
        # Horovod does for integer averages.
        tensor.copy_(tensor.to(torch.float64).mul_(factor).trunc_())


@dataclasses.dataclass(eq=False)
class _SetGroup:
    """One process set as this rank sees it: its ranks, our place, its data planes."""

    id: int
    ranks: tuple[int, ...]
    index: int | None  # our position in ``ranks``; None when we are not a member
    backends: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Sets other than the global one run their responses on their own thread,
    # so that a collective blocked in one set never holds up another set.
    queue: queue.SimpleQueue[list[negotiation_pb2.Response] | None] | None = None
    thread: threading.Thread | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)


_ERROR_CLASSES: dict[int, type[HoraError]] = {
    negotiation_pb2.ERROR_KIND_RANK_GONE: RankLostError,
    negotiation_pb2.ERROR_KIND_INVALID: InvalidCallError,
}


# Values a joined rank contributes to an allreduce: the identity of the reduction.
def _identity(op: ReduceOp, dtype: torch.dtype) -> float | int | bool:
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return 0
    if op == ReduceOp.PRODUCT:
        return 1
    if dtype == torch.bool:  # and for Min, or for Max
        return op == ReduceOp.MIN
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    if op == ReduceOp.MIN:
        return float("inf") if dtype.is_floating_point else info.max
    return float("-inf") if dtype.is_floating_point else info.min


class Engine:
    """Negotiates and runs the collectives of one worker in one generation.

    Args:
        settings: the worker's settings.
        client: the coordinator client (the engine does not own it).
        world: this worker's world view for the generation.
    """

    def __init__(self, settings: Settings, client: CoordinatorClient,
                 world: rendezvous_pb2.WorldView) -> None:
        self.settings = settings
        self.world = world
        self.rank = world.rank
        self.size = world.size
        self._client = client
        self._lock = threading.Lock()
        self._pending: dict[str, Entry] = {}
        self._failure: HoraError | None = None
        self._stopping = threading.Event()
        # Round loop state (global set): coordinator lists waiting for a round,
        # cached allreduces marked ready, and slots this rank must invalidate.
        self._work = threading.Condition(self._lock)
        self._lists: collections.deque[list[negotiation_pb2.Response]] = collections.deque()
        self._received = 0
        self._executed = 0
        self._cache = ResponseCache(settings.cache_capacity)
        self._cache_on = settings.cache_capacity > 0
        self._cached_pending: dict[int, Entry] = {}
        self._unclassified: list[Entry] = []
        self._invalid_slots: set[int] = set()
        self._join_announced = False
        self.rounds = 0
        self.mesh_batches = 0  # batches reduced from payloads the rounds carried
        # One thread at a time runs a round: the background thread or a
        # caller waiting on a handle (see _drive).
        self._round_busy = False
        self._waiting_drivers = 0
        self._cycle_s = settings.cycle_time.total_seconds()
        # Rank 0 decides fusion threshold and cycle time for the cached path
        # (the others adopt its values through the round's control vector).
        self._threshold_kib = settings.fusion_threshold // 1024
        self._cycle_us = int(settings.cycle_time.total_seconds() * 1e6)
        self._tuner: Autotuner | None = None
        if settings.autotune and world.rank == 0:
            # Horovod's --autotune-warmup-samples / --autotune-bayes-opt-max-samples.
            limits = {key: value for key, value in (
                ("warmup_samples", settings.autotune_warmup_samples),
                ("max_candidates", settings.autotune_max_samples)) if value is not None}
            self._tuner = Autotuner(log_file=settings.autotune_log or None,
                                    initial=(settings.fusion_threshold,
                                             settings.cycle_time.total_seconds() * 1e3),
                                    **limits)
        self._tuned_bytes = 0
        self._tuned_since = time.monotonic()
        self.timeline: Timeline | NullTimeline = NULL_TIMELINE
        if settings.timeline:
            self.start_timeline(settings.timeline, settings.timeline_mark_cycles)
        self._fusion_buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._sets: dict[int, _SetGroup] = {
            0: _SetGroup(0, tuple(range(world.size)), world.rank)}
        self._join: Entry | None = None
        self._host_epoch: tuple[int, bool] = (0, False)
        # The Python store object must outlive every C++ wrapper around it:
        # torch's trampoline finds its methods through this reference.
        self._coordinator_store = CoordinatorStore(client, settings.start_timeout)
        self._store = dist.PrefixStore(world.store_prefix, self._coordinator_store)
        self._backend("cpu", self._sets[0])  # every rank builds the CPU data plane at init
        # Rounds agree over direct connections in small worlds (one TCP round
        # trip), through a Gloo allreduce in large ones.
        from hora_native.control import MAX_MESH_SIZE, ControlMesh

        self._mesh: ControlMesh | None = None
        if 1 < world.size <= MAX_MESH_SIZE:
            self._mesh = ControlMesh(
                dist.PrefixStore("ctl/", self._store), world.rank, world.size,
                settings.collective_timeout,
                world.members[world.rank].data_plane_address or settings.data_plane_address,
                shared_memory=settings.shm_allreduce_bytes > 0,
                shm_prefix=segment_prefix(settings.job_id))
        # The most payload bytes a rank sends with its control vector. Rank 0's
        # choice reaches everyone through the vector, since every rank must
        # compute every other rank's payload layout the same way; until the
        # first round has agreed on it, rounds carry no payload.
        self._payload_budget = 0
        if self._mesh is not None:
            self._payload_budget = (settings.shm_allreduce_bytes if self._mesh.shared
                                    else settings.mesh_allreduce_bytes // (world.size - 1))
        self._agreed_budget = 0
        self._layouts: dict[tuple[int, ...], tuple[dict[int, int], int]] = {}
        self._layouts_key = (-1, -1)
        self._note_heartbeat(client.heartbeat(world.generation))
        self._stream: NegotiationStream = client.open_stream(world.generation)
        self._threads = [
            threading.Thread(target=self._read_loop, name="hora-reader", daemon=True),
            threading.Thread(target=self._round_loop, name="hora-rounds", daemon=True),
            threading.Thread(target=self._heartbeat_loop, name="hora-heartbeat", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # -- caller side --------------------------------------------------------

    def enqueue(self, entry: Entry) -> Handle:
        """Submits ``entry`` for negotiation and returns its handle.

        Raises:
            InvalidCallError: a tensor with the same name is already in flight (a
                ValueError, as in Horovod, and a RuntimeError).
            HorovodInternalError: the generation has failed.
        """
        timeline = self.timeline
        with self._lock:
            if self._failure is not None:
                raise type(self._failure)(str(self._failure))
            if entry.name in self._pending:
                raise InvalidCallError(
                    f"a tensor named {entry.name!r} is already in flight on rank {self.rank}; "
                    f"names must be unique among pending operations")
            self._pending[entry.name] = entry
            if entry.process_set_id == 0:
                entry.handle.driver = self._drive
            timeline.negotiate_start(entry.name, entry.op_type)
            if entry.op_type == OpType.JOIN:
                self._join = entry
                self._join_announced = False
                self._work.notify()
            elif self._cache_on and entry.cacheable():
                # The round loop decides hit or miss: it owns the cache, and at
                # its round boundaries every rank's cache is the same.
                self._unclassified.append(entry)
                self._work.notify()
                return entry.handle
        self._stream.send(entry.request())
        return entry.handle

    def _classify(self) -> list[Entry]:
        """Sorts new cacheable entries into cache hits; returns the misses to send.

        A cached name whose signature changed is announced invalid, so that
        every rank drops the slot and asks the coordinator again. Called with
        the lock held, by the thread running the round.
        """
        misses = []
        for entry in self._unclassified:
            found = self._cache.lookup(entry.name) if self._cache_on else None
            if found is None:
                misses.append(entry)
                continue
            slot, signature = found
            # An invalid call must reach the coordinator on every rank: the
            # slot is dropped everywhere, so the valid ranks ask it too.
            if entry.invalid or signature != entry.signature():
                self._invalid_slots.add(slot)
                misses.append(entry)
                continue
            self._cached_pending[slot] = entry
        self._unclassified.clear()
        return misses

    def failure(self) -> HoraError | None:
        return self._failure

    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        """Starts writing a Chrome trace to ``path`` (rank 0 only, as Horovod does)."""
        if self.rank != 0:
            return
        self.stop_timeline()
        self.timeline = Timeline(path, self.rank, mark_cycles=mark_cycles)

    def stop_timeline(self) -> None:
        timeline, self.timeline = self.timeline, NULL_TIMELINE
        timeline.close()

    def host_update_epoch(self) -> tuple[int, bool]:
        """The newest host-change epoch seen in heartbeats, and whether it only removed hosts."""
        return self._host_epoch

    def process_set(self, process_set_id: int) -> _SetGroup:
        """The registered process set ``process_set_id``.

        Raises:
            ValueError: no such set was added.
        """
        found = self._sets.get(process_set_id)
        if found is None:
            raise ValueError(f"process set {process_set_id} has not been added "
                             f"(or was removed); call hvd.add_process_set first")
        return found

    def add_process_set(self, process_set_id: int, ranks: Sequence[int]) -> None:
        """Registers a set with the coordinator and builds its CPU data plane.

        Every rank calls this together; the members' process group forms
        only once all of them have called it.
        """
        ranks = tuple(sorted(ranks))
        self._client.add_process_set(self.world.generation, process_set_id, list(ranks))
        group = _SetGroup(process_set_id, ranks,
                          ranks.index(self.rank) if self.rank in ranks else None)
        self._sets[process_set_id] = group
        if group.index is not None:
            self._backend("cpu", group)
            group.queue = queue.SimpleQueue()
            group.thread = threading.Thread(target=self._set_loop, args=(group,),
                                            name=f"hora-set-{process_set_id}", daemon=True)
            group.thread.start()

    def remove_process_set(self, process_set_id: int) -> None:
        group = self._sets.pop(process_set_id, None)
        if group is None:
            return
        self._client.remove_process_set(self.world.generation, process_set_id)
        if group.queue is not None:
            group.queue.put(None)
            group.thread.join(timeout=self.settings.collective_timeout.total_seconds())
        for backend in group.backends.values():
            backend.close()

    # -- failure ------------------------------------------------------------

    def _fail(self, error: HoraError) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = error
            pending, self._pending = self._pending, {}
            self._cached_pending.clear()
            self._unclassified.clear()
            self._work.notify_all()
        if pending and not self._stopping.is_set():
            log.error("rank %d: failing %d pending tensor(s) (%s): %s", self.rank, len(pending),
                      ", ".join(sorted(pending)[:5]), error)
        for entry in pending.values():
            entry.handle.set_error(self._failure)

    # -- reader thread --------------------------------------------------------

    def _read_loop(self) -> None:
        try:
            for message in self._stream:
                kind = message.WhichOneof("kind")
                if kind == "responses":
                    self._dispatch(message.responses.responses)
                elif kind == "event":
                    self._on_event(message.event)
        except CoordinatorError as exc:
            if not self._stopping.is_set():
                self._fail(HorovodInternalError(f"lost the coordinator: {exc}"))
        else:
            if not self._stopping.is_set():
                self._fail(HorovodInternalError(
                    f"the coordinator {self.settings.coordinator} closed the negotiation stream"))
        finally:
            with self._lock:
                self._work.notify_all()
            for group in list(self._sets.values()):
                if group.queue is not None:
                    group.queue.put(None)

    def _dispatch(self, responses: Sequence[negotiation_pb2.Response]) -> None:
        """Routes one response list: errors at once, collectives to their set's executor.

        Errors move no bytes, and some go to one rank only, so they must not
        take part in the rounds every rank counts.
        """
        by_set: dict[int, list[negotiation_pb2.Response]] = {}
        timeline = self.timeline
        errors = False
        for response in responses:
            for name in response.tensor_names:
                timeline.negotiate_end(name)
            if response.type == negotiation_pb2.RESPONSE_TYPE_ERROR:
                self._execute(response)
                errors = True
            else:
                op = _RESPONSE_OP.get(response.type)
                for name in response.tensor_names:
                    if op is not None:
                        timeline.start(name, op)
                    timeline.activity_start(name, "QUEUE")
                by_set.setdefault(response.process_set_id, []).append(response)
        for set_id, batch in by_set.items():
            if set_id == 0:
                with self._lock:
                    self._lists.append(batch)
                    self._received += 1
                    self._work.notify_all()
                continue
            group = self._sets.get(set_id)
            if group is None or group.queue is None:
                log.error("rank %d: responses for process set %d, which it does not run",
                          self.rank, set_id)
                continue
            group.queue.put(batch)
        if errors:
            with self._lock:
                self._work.notify_all()  # callers waiting on a failed handle

    def _on_event(self, event: negotiation_pb2.Event) -> None:
        if event.type == negotiation_pb2.EVENT_TYPE_MEMBER_LOST:
            self._fail(RankLostError(
                f"rank {event.rank} (host {event.host}, pid {event.pid}) was lost: "
                f"{event.message}"))
        elif event.type == negotiation_pb2.EVENT_TYPE_JOB_FAILED:
            self._fail(HorovodInternalError(f"the job failed: {event.message}"))
        elif event.type == negotiation_pb2.EVENT_TYPE_MEMBER_LEFT:
            log.info("rank %d (host %s, pid %d) left the job", event.rank, event.host, event.pid)
        elif event.type == negotiation_pb2.EVENT_TYPE_STALL_WARNING:
            log.warning(
                "rank %d: tensor %s has waited more than %g s for rank(s) %s to submit it; "
                "one rank may be doing different work (or a different number of steps)",
                self.rank, ", ".join(repr(n) for n in event.tensor_names),
                self.settings.stall_warning_time.total_seconds(), list(event.missing_ranks))

    # -- heartbeat thread ---------------------------------------------------

    def _heartbeat_loop(self) -> None:
        interval = self.settings.heartbeat_interval.total_seconds()
        # Transient coordinator hiccups are fine; silence longer than the
        # connect timeout means nobody will tell us about dead peers.
        grace = max(self.settings.connect_timeout.total_seconds(), 3 * interval)
        last_ok = time.monotonic()
        while not self._stopping.wait(interval):
            try:
                reply = self._client.heartbeat(self.world.generation)
            except CoordinatorError as exc:
                if time.monotonic() - last_ok > grace:
                    self._fail(HorovodInternalError(
                        f"no heartbeat answer from the coordinator for {grace:g} s: {exc}"))
                    return
                continue
            last_ok = time.monotonic()
            self._note_heartbeat(reply)
            self._warn_cached_stalls()

    def _note_heartbeat(self, reply: rendezvous_pb2.HeartbeatResponse) -> None:
        if reply.job_state == rendezvous_pb2.JOB_STATE_FAILED:
            self._fail(HorovodInternalError(f"the job failed: {reply.failure}"))
        self._host_epoch = (reply.host_update_epoch, reply.removals_only)

    def _warn_cached_stalls(self) -> None:
        """Stall warnings for cached tensors, which the coordinator does not see."""
        limit = self.settings.stall_warning_time.total_seconds()
        if limit <= 0:
            return
        now = time.monotonic()
        with self._lock:
            stalled = [e for e in self._cached_pending.values()
                       if not e.stall_warned and now - e.enqueued_at > limit]
            for entry in stalled:
                entry.stall_warned = True
        if not stalled:
            return
        # The agreement round this rank is in names the peers it waits for.
        waiting = self._mesh.waiting_for if self._mesh is not None else ()
        missing = f"; ranks {sorted(waiting)} have not come to the agreement round" \
            if waiting else ""
        for entry in stalled:
            log.warning("rank %d: tensor %r (negotiated before, agreed peer to peer) has "
                        "waited more than %g s for the other ranks to submit it%s", self.rank,
                        entry.name, limit, missing)

    # -- executors ------------------------------------------------------------

    def _run_safely(self, response: negotiation_pb2.Response | None, work: Callable[[], None]
                    ) -> None:
        names = list(response.tensor_names)[:3] if response is not None else []
        try:
            work()
        except BackendError as exc:
            self._fail(HorovodInternalError(
                f"data plane failed on rank {self.rank} running {names}: {exc}"))
        except HoraError as exc:
            self._fail(exc)
        except Exception as exc:  # noqa: BLE001 - a bug must fail handles, not hang them
            log.exception("rank %d: executing %s failed", self.rank, names)
            self._fail(HorovodInternalError(f"internal error on rank {self.rank}: {exc}"))

    def _set_loop(self, group: _SetGroup) -> None:
        """Runs a non-global process set's responses in the order the coordinator sent them."""
        assert group.queue is not None
        while True:
            batch = group.queue.get()
            if batch is None:
                return
            for response in batch:
                self._run_safely(response, lambda r=response: self._execute(r))

    def _needs_round(self) -> bool:
        """Whether this rank has something the other ranks must agree on."""
        return bool(self._cached_pending or self._invalid_slots
                    or self._received > self._executed
                    or (self._join is not None and not self._join_announced))

    def _round_work(self) -> bool:
        return bool(self._unclassified) or self._needs_round()

    def _round_loop(self) -> None:
        """The global set's background executor: runs rounds nobody waits for.

        A caller waiting on a handle runs the rounds itself (:meth:`_drive`),
        so this thread matters for asynchronous work, such as gradients
        allreduced while the backward pass goes on.
        """
        while True:
            with self._lock:
                while self._round_busy or not self._round_work():
                    if self._stopping.is_set() or self._failure is not None:
                        return
                    self._work.wait(0.5)
                if self._stopping.is_set() or self._failure is not None:
                    return
                self._round_busy = True
            try:
                self._round(background=True)
            finally:
                self._end_round()

    def _drive(self, handle: Handle, deadline: float | None) -> None:
        """Runs rounds in the caller's thread until ``handle`` is done.

        One thread at a time runs rounds (this caller, another caller or the
        background thread); the others wait for it. Returns early when the
        generation fails or stops, or at ``deadline`` (a monotonic time).
        """
        while not handle.done():
            with self._lock:
                while self._round_busy or not self._round_work():
                    if (handle.done() or self._failure is not None
                            or self._stopping.is_set()):
                        return
                    wait = 0.5
                    if deadline is not None:
                        wait = min(wait, deadline - time.monotonic())
                        if wait <= 0:
                            return
                    self._waiting_drivers += 1
                    try:
                        self._work.wait(wait)
                    finally:
                        self._waiting_drivers -= 1
                if handle.done() or self._failure is not None or self._stopping.is_set():
                    return
                self._round_busy = True
            try:
                self._round(background=False)
            except BaseException as exc:
                # A round cut short (Ctrl-C in the caller, say) may leave a
                # peer's message unread: later rounds could not be matched.
                self._fail(HorovodInternalError(
                    f"rank {self.rank}: a round was interrupted ({exc!r}); this generation "
                    f"cannot run further collectives"))
                raise
            finally:
                self._end_round()

    def _end_round(self) -> None:
        with self._lock:
            self._round_busy = False
            # Wake whoever may go on: waiting callers (their handle may be
            # done, or work may be left) and the background thread.
            if self._waiting_drivers or self._round_work():
                self._work.notify_all()

    def _round(self, background: bool) -> None:
        """One round of peer-to-peer agreement, run by the thread that set ``_round_busy``.

        Every rank with work enters a round with a control vector: per cache
        slot 2 (ready here), 1 (not ready) or 0 (invalid here), then how many
        coordinator response lists it has received, whether its cache may be
        used, and rank 0's fusion threshold, cycle time and payload budget; its
        payload (see :meth:`_pack`) travels with it. The element-wise MIN
        gives every rank the same answer: run the slots ready everywhere, drop
        the invalid ones, run the coordinator lists every rank has. Ranks
        apply the same results in the same order, so their caches never
        diverge.
        """
        with self._lock:
            misses = self._classify()
        for entry in misses:
            self._stream.send(entry.request())
        with self._lock:
            if not self._needs_round():
                return  # only misses: the coordinator answers, then we meet
        if background and self._cycle_s > 0:
            time.sleep(self._cycle_s)  # let more tensors become ready, for fusion
        with self._lock:
            width = len(self._cache)
            control = [1] * (width + 5)
            ready = sorted(self._cached_pending.items())
            for slot, _entry in ready:
                control[slot] = 2
            for slot in self._invalid_slots:
                control[slot] = 0
            self._invalid_slots.clear()
            control[width] = self._received
            usable = self._cache_on and self._join is None
            control[width + 1] = 1 if usable else 0
            # Values only rank 0 sets; every other rank sends the largest
            # value, so the MIN hands everyone rank 0's.
            control[width + 2] = self._threshold_kib if self.rank == 0 else _UNSET
            control[width + 3] = self._cycle_us if self.rank == 0 else _UNSET
            control[width + 4] = self._payload_budget if self.rank == 0 else _UNSET
            if self._join is not None:
                self._join_announced = True
        payload = self._pack(ready)
        try:
            control, messages = self._control_exchange(control, payload)
        except BackendError as exc:
            self._fail(HorovodInternalError(
                f"data plane failed on rank {self.rank} agreeing on ready tensors: {exc}"))
            return
        self.rounds += 1
        self.timeline.cycle_start()
        self._cycle_s = int(control[width + 3]) / 1e6
        self._run_safely(None, lambda: self._apply_round(control, width, messages))
        self._agreed_budget = int(control[width + 4])
        if self._tuner is not None:
            self._autotune_step()

    def _layout(self, slots: Iterable[int]) -> tuple[dict[int, int], int]:
        """Which ready tensors a rank sends with its control vector, and where.

        ``slots`` are the cache slots the rank marked ready, in ascending
        order. A tensor travels in the payload when it is a non-empty CPU
        tensor of a dtype the mesh reduces and the payload stays within the
        budget the last round agreed on (rank 0's: shared-memory bytes, or
        socket bytes per peer; see ``__init__``). Tensors
        sit back to back in slot order; a change of dtype starts at the next
        8-byte boundary, so that each can be viewed in place. Every rank
        computes every rank's layout from its vector and the (identical)
        caches. Returns {slot: byte offset} and the payload's length.
        """
        budget = self._agreed_budget
        if self._mesh is None or budget <= 0:
            return {}, 0
        slots = tuple(slots)
        # The same tensors are ready round after round in training: keep the
        # layouts until the cache or the budget changes.
        if self._layouts_key != (self._cache.version, budget):
            self._layouts.clear()
            self._layouts_key = (self._cache.version, budget)
        found = self._layouts.get(slots)
        if found is None:
            found = self._layouts[slots] = self._compute_layout(slots, budget)
        return found

    def _compute_layout(self, slots: tuple[int, ...], budget: int
                        ) -> tuple[dict[int, int], int]:
        signature = self._cache.signature
        offsets, total, dtype = {}, 0, None
        for slot in slots:
            sig = signature(slot)
            nbytes = sig.nbytes
            if not nbytes or sig.device != "cpu" or sig.dtype not in _MESH_DTYPE_NAMES:
                continue
            start = total if sig.dtype == dtype else (total + 7) & ~7
            if start + nbytes > budget:
                continue
            offsets[slot], total, dtype = start, start + nbytes, sig.dtype
        return offsets, total

    def _pack(self, ready: list[tuple[int, Entry]]) -> torch.Tensor | None:
        """This rank's payload: the bytes of the ready tensors :meth:`_layout` picks."""
        layout, total = self._layout(slot for slot, _entry in ready)
        if not layout:
            return None
        assert self._mesh is not None
        send = self._mesh.payload_buffer(total)
        # Copy runs of tensors that lie back to back with one call each.
        runs: list[list[Any]] = []  # [start, end, tensors]
        for slot, entry in ready:
            offset = layout.get(slot)
            if offset is None:
                continue
            flat = entry.buffer
            if flat.dim() != 1:
                flat = flat.view(-1)
            end = offset + flat.nbytes
            if runs and runs[-1][1] == offset and runs[-1][2][0].dtype == flat.dtype:
                runs[-1][1] = end
                runs[-1][2].append(flat)
            else:
                runs.append([offset, end, [flat]])
        for start, end, tensors in runs:
            out = send[start:end].view(tensors[0].dtype)
            if len(tensors) == 1:
                out.copy_(tensors[0])
            else:
                torch.cat(tensors, out=out)
        return send

    def _control_exchange(self, values: list[int], payload: torch.Tensor | None
                          ) -> tuple[list[int], list[tuple[list[int], torch.Tensor | None]] | None]:
        """The element-wise MIN of every rank's control vector, and every rank's message
        when the mesh carried payloads."""
        if self._mesh is not None:
            messages = self._mesh.exchange(values, payload)
            agreed = values
            for peer, (theirs, _payload) in enumerate(messages):
                if peer != self.rank:
                    agreed = [a if a < b else b for a, b in zip(agreed, theirs, strict=True)]
            return agreed, messages
        group = self._sets[0]
        if group.size == 1:
            return values, None
        tensor = torch.tensor(values, dtype=torch.int64)
        self._backend("cpu", group).allreduce(tensor, ReduceKind.MIN)
        return tensor.tolist(), None

    def _apply_round(self, control: list[int], width: int,
                     messages: list[tuple[list[int], torch.Tensor | None]] | None) -> None:
        values = control[:width]
        agreed = int(control[width])
        usable = bool(control[width + 1])
        threshold = int(control[width + 2]) * 1024
        # Where each rank's payload holds which tensors, read before step 1
        # empties any slot.
        layouts = None
        if messages is not None and 2 in values:
            layouts = []
            for theirs, payload in messages:
                layout, total = self._layout(
                    [slot for slot in range(width) if theirs[slot] == 2])
                # A rank that could not send its payload sent none: its
                # tensors go through Gloo, on every rank alike.
                sent = payload is not None and payload.numel() == total
                layouts.append(layout if sent else {})
        # 1. Slots some rank found stale: drop them; our own waiting tensors
        #    go to the coordinator instead.
        resend = []
        with self._lock:
            for slot, value in enumerate(values):
                if value == 0:
                    self._cache.evict(slot)
                    entry = self._cached_pending.pop(slot, None)
                    if entry is not None:
                        resend.append(entry)
            ready = []
            timeline = self.timeline
            for slot, value in enumerate(values):
                if value == 2:
                    entry = self._cached_pending.pop(slot, None)
                    if entry is None:  # failed meanwhile; the rounds stop next
                        continue
                    ready.append((slot, self._cache.signature(slot), entry))
                    self._cache.touch(slot)
                    if timeline.active:
                        timeline.negotiate_end(entry.name)
                        timeline.start(entry.name, OpType.ALLREDUCE)
                        timeline.activity_start(entry.name, "QUEUE")
        for entry in resend:
            self._stream.send(entry.request())
        # 2. Slots ready everywhere: reduced from the payloads the round
        #    brought when every rank sent the tensor, else fused in slot
        #    order through Gloo.
        if layouts is not None:
            assert messages is not None
            carried, rest = [], []
            for item in ready:
                (carried if all(item[0] in lay for lay in layouts) else rest).append(item)
            self._run_mesh(carried, messages, layouts)
            ready = rest
        self._run_cached(ready, threshold)
        # 3. A rank has joined: stop using the cache until the join completes.
        if not usable and self._cache_on:
            self._set_cache(False)
        # 4. Coordinator lists that every rank has received.
        while self._executed < agreed:
            with self._lock:
                batch = self._lists.popleft()
            self._executed += 1
            for response in batch:
                self._remember(response, self._execute(response))

    def _batches(self, ready: list[tuple[int, Signature, Entry]], threshold: int
                 ) -> Iterator[list[tuple[int, Signature, Entry]]]:
        """Runs of ``ready`` (in slot order) that can share one fusion buffer: the same
        fusion key, at most ``threshold`` bytes (a larger tensor goes alone). Their
        names leave the pending table as each batch is handed out."""
        i = 0
        while i < len(ready):
            key = ready[i][1].fusion_key
            nbytes = ready[i][2].buffer.nbytes
            j = i + 1
            while j < len(ready) and ready[j][1].fusion_key == key:
                nbytes += ready[j][2].buffer.nbytes
                if nbytes > threshold:
                    break
                j += 1
            batch = ready[i:j]
            i = j
            with self._lock:
                for _slot, _sig, entry in batch:
                    self._pending.pop(entry.name, None)
            yield batch

    def _run_mesh(self, ready: list[tuple[int, Signature, Entry]],
                  messages: list[tuple[list[int], torch.Tensor | None]],
                  layouts: list[dict[int, int]]) -> None:
        """Reduces tensors whose bytes every rank sent with the round's vector.

        Each rank combines the contributions in rank order, so every rank
        computes the same bits.
        """
        for batch in self._batches(ready, sys.maxsize):
            entries = [entry for _slot, _sig, entry in batch]
            names = [entry.name for entry in entries]
            self._activity(names, "QUEUE", "MESH_ALLREDUCE")
            first = entries[0]
            dtype = first.buffer.dtype
            nbytes = sum(entry.buffer.nbytes for entry in entries)
            # Each rank's contribution as one flat tensor: a view of its
            # payload when the batch lies back to back there (the usual case:
            # every rank was ready with the same tensors), else gathered.
            flats = []
            first_slot, last_slot = batch[0][0], batch[-1][0]
            last_nbytes = entries[-1].buffer.nbytes
            for (_values, payload), layout in zip(messages, layouts, strict=True):
                assert payload is not None
                start = layout[first_slot]
                if layout[last_slot] + last_nbytes - start == nbytes:
                    flats.append(payload[start:start + nbytes].view(dtype))
                else:
                    flats.append(torch.cat([payload[layout[slot]:layout[slot] + sig.nbytes]
                                            .view(dtype) for slot, sig, _entry in batch]))
            pre = first.prescale_factor
            if len(entries) == 1:
                acc = _flat(first.buffer)
            else:
                acc = self._fusion_buffer(dtype, first.buffer.device, nbytes // dtype.itemsize)
            acc.copy_(flats[0])
            _scale(acc, pre)
            reduce = _REDUCE_INTO[first.reduce_op]
            for theirs in flats[1:]:
                if pre != 1.0:
                    theirs = theirs.clone()
                    _scale(theirs, pre)
                reduce(acc, theirs)
            _scale(acc, _post_factor(first, self.size))
            if len(entries) > 1:
                _unpack(entries, acc)
            self._activity(names, "MESH_ALLREDUCE", None)
            for entry in entries:
                self._finish(entry, entry.buffer)
            self._tuned_bytes += nbytes
            self.mesh_batches += 1

    def _run_cached(self, ready: list[tuple[int, Signature, Entry]], threshold: int) -> None:
        """Allreduces cached tensors through the data plane, fused up to ``threshold``."""
        group = self._sets[0]
        for batch in self._batches(ready, threshold):
            entries = [entry for _slot, _sig, entry in batch]
            backend = self._backend(entries[0].buffer.device.type, group)
            self._allreduce(backend, entries, group.size)
            self._tuned_bytes += sum(entry.buffer.nbytes for entry in entries)

    def _autotune_step(self) -> None:
        """Feeds rank 0's tuner one window of cached-allreduce throughput."""
        assert self._tuner is not None
        elapsed = time.monotonic() - self._tuned_since
        if elapsed < 0.2 or self._tuner.done():
            return
        changed = self._tuner.record(self._tuned_bytes, elapsed)
        self._tuned_bytes, self._tuned_since = 0, time.monotonic()
        if changed:
            threshold, cycle_ms = self._tuner.current()
            self._threshold_kib = threshold // 1024
            self._cycle_us = int(cycle_ms * 1000)
        if self._tuner.done():
            threshold, cycle_ms, score = self._tuner.best()
            self._threshold_kib, self._cycle_us = threshold // 1024, int(cycle_ms * 1000)
            log.warning("autotune chose a fusion threshold of %g MiB and a cycle time of %g ms "
                        "(%.1f MB/s reduced)", threshold / 2**20, cycle_ms, score / 1e6)

    def _remember(self, response: negotiation_pb2.Response, entries: list[Entry]) -> None:
        """Caches a negotiated allreduce so that its next occurrence skips the coordinator."""
        if (not self._cache_on or response.type != negotiation_pb2.RESPONSE_TYPE_ALLREDUCE
                or response.process_set_id != 0 or response.join_fill):
            return
        if not entries or any(not e.cacheable() for e in entries):
            return
        resend = []
        with self._lock:
            for entry in entries:
                _, evicted = self._cache.put(entry.name, entry.signature())
                if evicted is not None:
                    waiting = self._cached_pending.pop(evicted, None)
                    if waiting is not None:
                        resend.append(waiting)
        for entry in resend:
            self._stream.send(entry.request())

    def _set_cache(self, on: bool) -> None:
        resend = []
        with self._lock:
            self._cache_on = on and self.settings.cache_capacity > 0
            if not on:
                self._cache.clear()
                resend = list(self._cached_pending.values())
                self._cached_pending.clear()
        for entry in resend:
            self._stream.send(entry.request())

    def _take(self, names: Sequence[str]) -> list[Entry]:
        with self._lock:
            return [self._pending.pop(name) for name in names if name in self._pending]

    def _execute(self, response: negotiation_pb2.Response) -> list[Entry]:
        """Runs one response on the data plane; returns the local entries it completed."""
        if response.type == negotiation_pb2.RESPONSE_TYPE_JOIN:
            with self._lock:
                join, self._join = self._join, None
                if join is not None:
                    self._pending.pop(join.name, None)
            if join is not None:
                self._finish(join, response.last_joined_rank)
            self._set_cache(True)
            return []
        entries = self._take(response.tensor_names)
        if response.join_fill and len(entries) < len(response.tensor_names):
            entries = self._fill_for_join(response, entries)
        if response.type == negotiation_pb2.RESPONSE_TYPE_ERROR:
            error_cls = _ERROR_CLASSES.get(response.error_kind, TensorMismatchError)
            for entry in entries:
                entry.handle.set_error(error_cls(response.error_message))
            return []
        if len(entries) != len(response.tensor_names):
            raise HorovodInternalError(
                f"rank {self.rank} got a response for tensors it does not have pending: "
                f"{list(response.tensor_names)}")
        op = _RESPONSE_OP[response.type]
        group = self.process_set(response.process_set_id)
        backend = self._backend(entries[0].buffer.device.type, group)
        if op != OpType.ALLREDUCE:
            self._activity([e.name for e in entries], "QUEUE",
                           f"{backend.name.upper()}_{op.name}")
        if op == OpType.ALLREDUCE:
            self._allreduce(backend, entries, group.size)
        elif op == OpType.ALLGATHER:
            self._allgather(backend, entries, response.first_dims, group.size)
        elif op == OpType.BROADCAST:
            entry = entries[0]
            backend.broadcast(entry.buffer, group.ranks.index(entry.root_rank))
            self._finish(entry, entry.buffer)
        elif op == OpType.ALLTOALL:
            self._alltoall(backend, entries[0], response.splits, group)
        elif op == OpType.REDUCESCATTER:
            self._reducescatter(backend, entries[0], group)
        elif op == OpType.BARRIER:
            backend.barrier()
            self._finish(entries[0], None)
        return entries

    def _finish(self, entry: Entry, value: Any) -> None:
        self.timeline.end(entry.name)
        entry.handle.set_result(entry.result(value) if entry.result else value)

    def _fill_for_join(self, response: negotiation_pb2.Response,
                       entries: list[Entry]) -> list[Entry]:
        """Stand-ins for tensors this joined rank never submitted: identity values."""
        have = {e.name: e for e in entries}
        filled = []
        for name, meta in zip(response.tensor_names, response.join_fill, strict=True):
            entry = have.get(name)
            if entry is None:
                dtype = getattr(torch, meta.dtype)
                op = ReduceOp(meta.reduce_op)
                buffer = torch.full(tuple(meta.shape), _identity(op, dtype), dtype=dtype,
                                    device=meta.device or "cpu")
                entry = Entry(name=name, op_type=OpType.ALLREDUCE, buffer=buffer,
                              handle=Handle(name), reduce_op=op,
                              prescale_factor=meta.prescale_factor,
                              postscale_factor=meta.postscale_factor,
                              process_set_id=meta.process_set_id)
            filled.append(entry)
        return filled

    def _backend(self, device_type: str, group: _SetGroup) -> Any:
        name = backend_for_device(device_type)
        backend = group.backends.get(name)
        if backend is None:
            if group.index is None:
                raise HorovodInternalError(
                    f"rank {self.rank} got work for process set {group.id}, which it is not in")
            prefix = f"{name}/" if group.id == 0 else f"set{group.id}/{name}/"
            backend = create_backend(
                name, dist.PrefixStore(prefix, self._store), group.index, group.size,
                self.settings.collective_timeout, self.world.members[self.rank].data_plane_address
                or self.settings.data_plane_address)
            group.backends[name] = backend
        return backend

    def _fusion_buffer(self, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        key = (dtype, device)
        buf = self._fusion_buffers.get(key)
        if buf is None or buf.numel() < numel:
            # Grow geometrically so a slowly growing model does not reallocate every step.
            size = max(numel, 2 * buf.numel() if buf is not None else 0)
            buf = torch.empty(size, dtype=dtype, device=device)
            self._fusion_buffers[key] = buf
        return buf[:numel]

    def _allreduce(self, backend: Any, entries: list[Entry], set_size: int) -> None:
        first = entries[0]
        kind = _NATIVE_REDUCE[first.reduce_op]
        names = [e.name for e in entries]
        self._activity(names, "QUEUE", None)
        if len(entries) == 1:
            buf = first.buffer
        else:
            total = sum(e.buffer.numel() for e in entries)
            self._activity(names, None, "MEMCPY_IN_FUSION_BUFFER")
            buf = self._fusion_buffer(first.buffer.dtype, first.buffer.device, total)
            torch.cat([e.buffer.reshape(-1) for e in entries], out=buf)
            self._activity(names, "MEMCPY_IN_FUSION_BUFFER", None)
        activity = f"{backend.name.upper()}_ALLREDUCE"
        self._activity(names, None, activity)
        _scale(buf, first.prescale_factor)
        backend.allreduce(buf, kind)
        _scale(buf, _post_factor(first, set_size))
        self._activity(names, activity, None)
        if len(entries) == 1:
            self._finish(first, buf)
            return
        self._activity(names, None, "MEMCPY_OUT_FUSION_BUFFER")
        _unpack(entries, buf)
        self._activity(names, "MEMCPY_OUT_FUSION_BUFFER", None)
        for entry in entries:
            self._finish(entry, entry.buffer)

    def _activity(self, names: list[str], end: str | None, start: str | None) -> None:
        timeline = self.timeline
        if not timeline.active:
            return
        for name in names:
            if end is not None:
                timeline.activity_end(name)
            if start is not None:
                timeline.activity_start(name, start)

    def _allgather(self, backend: Any, entries: list[Entry], first_dims: Sequence[int],
                   set_size: int) -> None:
        for i, entry in enumerate(entries):
            counts = list(first_dims[i * set_size:(i + 1) * set_size])
            tensor = entry.buffer
            output = tensor.new_empty((sum(counts),) + tuple(tensor.shape[1:]))
            backend.allgatherv(output, tensor, counts)
            self._finish(entry, output)

    def _alltoall(self, backend: Any, entry: Entry, matrix: Sequence[int],
                  group: _SetGroup) -> None:
        me, set_size = group.index, group.size
        send = [int(matrix[me * set_size + s]) for s in range(set_size)]
        recv = [int(matrix[r * set_size + me]) for r in range(set_size)]
        tensor = entry.buffer
        output = tensor.new_empty((sum(recv),) + tuple(tensor.shape[1:]))
        backend.alltoallv(output, tensor, recv, send)
        self._finish(entry, (output, torch.tensor(recv, dtype=torch.int32)))

    def _reducescatter(self, backend: Any, entry: Entry, group: _SetGroup) -> None:
        set_size = group.size
        tensor = entry.buffer
        counts = split_rows(tensor.shape[0], set_size)
        _scale(tensor, entry.prescale_factor)
        output = tensor.new_empty((counts[group.index],) + tuple(tensor.shape[1:]))
        backend.reducescatter(output, tensor, _NATIVE_REDUCE[entry.reduce_op], counts)
        _scale(output, _post_factor(entry, set_size))
        self._finish(entry, output)

    # -- shutdown -------------------------------------------------------------

    def shutdown(self, timeout: timedelta = timedelta(seconds=10), rejoin: bool = False) -> None:
        """Leaves the job (or, with ``rejoin``, this generation), stops the threads
        and releases the data plane."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._client.leave(reason="reset" if rejoin else "shutdown", rejoin=rejoin)
        self._stream.close()
        self._fail(HorovodInternalError("hora has been shut down"))
        for group in self._sets.values():
            if group.queue is not None:
                group.queue.put(None)
                if group.thread is not None:
                    self._threads.append(group.thread)
        deadline = time.monotonic() + timeout.total_seconds()
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for group in self._sets.values():
            for backend in group.backends.values():
                backend.close()
            group.backends.clear()
        if self._mesh is not None:
            self._mesh.close()
        self.stop_timeline()
