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

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hora_native import BackendError, ReduceKind, backend_for_device, create_backend

from ._client import CoordinatorClient, NegotiationStream
from ._ops import OpType, ReduceOp, dtype_name, split_rows
from ._store import CoordinatorStore
from .errors import (
    CoordinatorError,
    HoraError,
    HorovodInternalError,
    RankLostError,
    TensorMismatchError,
)
from .settings import Settings
from .v1 import negotiation_pb2, rendezvous_pb2

__all__ = ["Engine", "Entry", "Handle"]

log = logging.getLogger("hora")

_NATIVE_REDUCE = {
    ReduceOp.SUM: ReduceKind.SUM,
    ReduceOp.AVERAGE: ReduceKind.SUM,
    ReduceOp.MIN: ReduceKind.MIN,
    ReduceOp.MAX: ReduceKind.MAX,
    ReduceOp.PRODUCT: ReduceKind.PRODUCT,
}

_RESPONSE_OP = {
    negotiation_pb2.RESPONSE_TYPE_ALLREDUCE: OpType.ALLREDUCE,
    negotiation_pb2.RESPONSE_TYPE_ALLGATHER: OpType.ALLGATHER,
    negotiation_pb2.RESPONSE_TYPE_BROADCAST: OpType.BROADCAST,
    negotiation_pb2.RESPONSE_TYPE_ALLTOALL: OpType.ALLTOALL,
    negotiation_pb2.RESPONSE_TYPE_REDUCESCATTER: OpType.REDUCESCATTER,
    negotiation_pb2.RESPONSE_TYPE_BARRIER: OpType.BARRIER,
}


class Handle:
    """The future of one enqueued collective."""

    __slots__ = ("name", "_done", "_result", "_error")

    def __init__(self, name: str) -> None:
        self.name = name
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def set_result(self, result: Any) -> None:
        self._result = result
        self._done.set()

    def set_error(self, error: BaseException) -> None:
        if not self._done.is_set():
            self._error = error
            self._done.set()

    def wait(self, timeout: float | None = None) -> Any:
        """Returns the result, or raises the collective's error.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
        """
        if not self._done.wait(timeout):
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

    def request(self) -> negotiation_pb2.TensorRequest:
        return negotiation_pb2.TensorRequest(
            name=self.name, op_type=int(self.op_type), dtype=dtype_name(self.buffer.dtype),
            shape=list(self.buffer.shape), device=self.buffer.device.type,
            reduce_op=int(self.reduce_op), root_rank=self.root_rank,
            prescale_factor=self.prescale_factor, postscale_factor=self.postscale_factor,
            process_set_id=self.process_set_id, splits=list(self.splits or ()),
            group_id=self.group_id, group_size=self.group_size)


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

    @property
    def size(self) -> int:
        return len(self.ranks)


# Values a joined rank contributes to an allreduce: the identity of the reduction.
def _identity(op: ReduceOp, dtype: torch.dtype) -> float | int | bool:
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return 0
    if op == ReduceOp.PRODUCT:
        return 1
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
        self._exec_queue: queue.SimpleQueue[list[negotiation_pb2.Response] | None] = (
            queue.SimpleQueue())
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
        self._stream: NegotiationStream = client.open_stream(world.generation)
        self._threads = [
            threading.Thread(target=self._read_loop, name="hora-reader", daemon=True),
            threading.Thread(target=self._exec_loop, name="hora-executor", daemon=True),
            threading.Thread(target=self._heartbeat_loop, name="hora-heartbeat", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # -- caller side --------------------------------------------------------

    def enqueue(self, entry: Entry) -> Handle:
        """Submits ``entry`` for negotiation and returns its handle.

        Raises:
            ValueError: a tensor with the same name is already in flight.
            HorovodInternalError: the generation has failed.
        """
        with self._lock:
            if self._failure is not None:
                raise type(self._failure)(str(self._failure))
            if entry.name in self._pending:
                raise ValueError(
                    f"a tensor named {entry.name!r} is already in flight on rank {self.rank}; "
                    f"names must be unique among pending operations")
            self._pending[entry.name] = entry
            if entry.op_type == OpType.JOIN:
                self._join = entry
        self._stream.send(entry.request())
        return entry.handle

    def failure(self) -> HoraError | None:
        return self._failure

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

    def remove_process_set(self, process_set_id: int) -> None:
        group = self._sets.pop(process_set_id, None)
        if group is None:
            return
        self._client.remove_process_set(self.world.generation, process_set_id)
        for backend in group.backends.values():
            backend.close()

    # -- failure ------------------------------------------------------------

    def _fail(self, error: HoraError) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = error
            pending, self._pending = self._pending, {}
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
                    self._exec_queue.put(list(message.responses.responses))
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
            self._exec_queue.put(None)

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
            if reply.job_state == rendezvous_pb2.JOB_STATE_FAILED:
                self._fail(HorovodInternalError(f"the job failed: {reply.failure}"))

    # -- executor thread ----------------------------------------------------

    def _exec_loop(self) -> None:
        while True:
            responses = self._exec_queue.get()
            if responses is None:
                return
            for response in responses:
                try:
                    self._execute(response)
                except BackendError as exc:
                    self._fail(HorovodInternalError(
                        f"data plane failed on rank {self.rank} running "
                        f"{list(response.tensor_names)[:3]}: {exc}"))
                except Exception as exc:  # noqa: BLE001 - a bug must fail handles, not hang them
                    log.exception("rank %d: executing %s failed", self.rank,
                                  list(response.tensor_names))
                    self._fail(HorovodInternalError(f"internal error on rank {self.rank}: {exc}"))

    def _take(self, names: Sequence[str]) -> list[Entry]:
        with self._lock:
            return [self._pending.pop(name) for name in names if name in self._pending]

    def _execute(self, response: negotiation_pb2.Response) -> None:
        if response.type == negotiation_pb2.RESPONSE_TYPE_JOIN:
            with self._lock:
                join, self._join = self._join, None
                if join is not None:
                    self._pending.pop(join.name, None)
            if join is not None:
                self._finish(join, response.last_joined_rank)
            return
        entries = self._take(response.tensor_names)
        if response.join_fill and len(entries) < len(response.tensor_names):
            entries = self._fill_for_join(response, entries)
        if response.type == negotiation_pb2.RESPONSE_TYPE_ERROR:
            error_cls = (RankLostError
                         if response.error_kind == negotiation_pb2.ERROR_KIND_RANK_GONE
                         else TensorMismatchError)
            for entry in entries:
                entry.handle.set_error(error_cls(response.error_message))
            return
        if len(entries) != len(response.tensor_names):
            raise HorovodInternalError(
                f"rank {self.rank} got a response for tensors it does not have pending: "
                f"{list(response.tensor_names)}")
        op = _RESPONSE_OP[response.type]
        group = self.process_set(response.process_set_id)
        backend = self._backend(entries[0].buffer.device.type, group)
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

    def _finish(self, entry: Entry, value: Any) -> None:
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
        post = first.postscale_factor
        if first.reduce_op == ReduceOp.AVERAGE:
            post /= set_size
        kind = _NATIVE_REDUCE[first.reduce_op]
        if len(entries) == 1:
            buf = first.buffer
        else:
            total = sum(e.buffer.numel() for e in entries)
            buf = self._fusion_buffer(first.buffer.dtype, first.buffer.device, total)
            torch.cat([e.buffer.reshape(-1) for e in entries], out=buf)
        _scale(buf, first.prescale_factor)
        backend.allreduce(buf, kind)
        _scale(buf, post)
        if len(entries) == 1:
            self._finish(first, buf)
            return
        offset = 0
        for entry in entries:
            n = entry.buffer.numel()
            entry.buffer.view(-1).copy_(buf[offset:offset + n])
            offset += n
            self._finish(entry, entry.buffer)

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
        post = entry.postscale_factor
        if entry.reduce_op == ReduceOp.AVERAGE:
            post /= set_size
        _scale(tensor, entry.prescale_factor)
        output = tensor.new_empty((counts[group.index],) + tuple(tensor.shape[1:]))
        backend.reducescatter(output, tensor, _NATIVE_REDUCE[entry.reduce_op], counts)
        _scale(output, post)
        self._finish(entry, output)

    # -- shutdown -------------------------------------------------------------

    def shutdown(self, timeout: timedelta = timedelta(seconds=10)) -> None:
        """Leaves the job, stops the threads and releases the data plane."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._client.leave()
        self._stream.close()
        self._fail(HorovodInternalError("hora has been shut down"))
        deadline = time.monotonic() + timeout.total_seconds()
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for group in self._sets.values():
            for backend in group.backends.values():
                backend.close()
            group.backends.clear()
