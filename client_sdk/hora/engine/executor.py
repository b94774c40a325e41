"""Running responses on the data plane: op dispatch, fusion and scaling.

The negotiator and the agreement rounds decide what runs and in which order;
this stage moves the bytes. A response names tensors pending on this rank;
the executor takes them from the pending table, runs the collective on the
process set's backend (fusing allreduces into a reused buffer) and
completes their handles. An allreduce is prescaled, reduced by the backend
and postscaled here, whichever backend the round chose (Gloo, NCCL, xccl,
or the mesh for bytes the round carried).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hora_native import Backend, BackendError, PlacedViews, ReduceKind, Reducer, scale_
from hora_native.base import Placement
from hora_proto.v1 import negotiation_pb2

from .._ops import OpType, ReduceOp, split_rows
from ..errors import (
    HoraError,
    HorovodInternalError,
    InvalidCallError,
    RankLostError,
    TensorMismatchError,
)
from ..timeline import NULL_TIMELINE, NullTimeline, Timeline
from .pending import Entry, Handle, Pending
from .plan import BackendSelector
from .process_sets import ProcessSets, SetGroup

__all__ = ["Executor", "RESPONSE_OP", "TimelineRef"]

log = logging.getLogger("hora")

RESPONSE_OP = {
    negotiation_pb2.RESPONSE_TYPE_ALLREDUCE: OpType.ALLREDUCE,
    negotiation_pb2.RESPONSE_TYPE_ALLGATHER: OpType.ALLGATHER,
    negotiation_pb2.RESPONSE_TYPE_BROADCAST: OpType.BROADCAST,
    negotiation_pb2.RESPONSE_TYPE_ALLTOALL: OpType.ALLTOALL,
    negotiation_pb2.RESPONSE_TYPE_REDUCESCATTER: OpType.REDUCESCATTER,
    negotiation_pb2.RESPONSE_TYPE_BARRIER: OpType.BARRIER,
}

_NATIVE_REDUCE = {
    ReduceOp.SUM: ReduceKind.SUM,
    ReduceOp.AVERAGE: ReduceKind.SUM,
    ReduceOp.MIN: ReduceKind.MIN,
    ReduceOp.MAX: ReduceKind.MAX,
    ReduceOp.PRODUCT: ReduceKind.PRODUCT,
}

_ERROR_CLASSES: dict[int, type[HoraError]] = {
    negotiation_pb2.ERROR_KIND_RANK_GONE: RankLostError,
    negotiation_pb2.ERROR_KIND_INVALID: InvalidCallError,
}


_set_grad_enabled = torch._C._set_grad_enabled

# The dtypes whose average the mesh divides while packing (see ``divides_early``).
_DIVIDED_EARLY = (torch.float32, torch.float64)


def divides_early(entry: Entry, set_size: int) -> bool:
    """Whether an average the round's payloads carry is divided by the set's
    size as each rank packs its contribution, in the pack's one pass, rather
    than in a pass over the result (section 2c of bench/README.md: 0.1 ms
    of a 3.3 MB step). Only where that changes no bit in the normal range:
    a power-of-2 size (scaling by it is exact, so the rounded sum of the
    scaled terms is the scaled rounded sum) and float32 or float64. What
    differs from dividing after: terms below the smallest normal number lose
    bits as they are divided, and a sum that would overflow to infinity stays
    finite when its average does."""
    return (entry.reduce_op == ReduceOp.AVERAGE and set_size & (set_size - 1) == 0
            and entry.buffer.dtype in _DIVIDED_EARLY)


def pre_factor(entry: Entry, set_size: int) -> float:
    """What the mesh multiplies a rank's contribution by as it packs it: the
    prescale, over the set size for an average divided early."""
    pre = entry.prescale_factor
    return pre / set_size if divides_early(entry, set_size) else pre


def post_factor(entry: Entry, set_size: int, carried: bool = False) -> float:
    """What a reduction's result is multiplied by: the postscale, over the set
    size for an average (unless ``carried`` by the payloads, which divided it
    early: :func:`divides_early`)."""
    post = entry.postscale_factor
    if entry.reduce_op != ReduceOp.AVERAGE or (carried and divides_early(entry, set_size)):
        return post
    return post / set_size


def identity(op: ReduceOp, dtype: torch.dtype) -> float | int | bool:
    """What a joined rank contributes to an allreduce: the reduction's identity."""
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return 0
    if op == ReduceOp.PRODUCT:
        return 1
    if dtype == torch.bool:  # and for Min, or for Max
        return op == ReduceOp.MIN
    if dtype.is_floating_point:
        return float("inf") if op == ReduceOp.MIN else float("-inf")
    info = torch.iinfo(dtype)
    return info.max if op == ReduceOp.MIN else info.min


class TimelineRef:
    """The generation's timeline, handed to the stages that write to it; the
    engine swaps ``current`` when a timeline starts or stops."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: Timeline | NullTimeline = NULL_TIMELINE


class Executor:
    """Runs responses on the data plane and completes their entries."""

    def __init__(self, rank: int, pending: Pending, sets: ProcessSets,
                 selector: BackendSelector, timeline: TimelineRef) -> None:
        self.rank = rank
        self._pending = pending
        self.sets = sets
        self._selector = selector
        self._timeline = timeline
        self._fusion_buffers: dict[tuple[torch.dtype, torch.device, int], torch.Tensor] = {}
        # Each batch's views of its fusion buffer (:meth:`_fused`).
        self._placed = PlacedViews()

    # -- running safely ---------------------------------------------------------

    def run_safely(self, names: Sequence[str], work: Callable[[], None]) -> None:
        """Runs ``work``; a failure fails the generation instead of escaping a thread,
        and completes with it the entries ``work`` had taken out of the table."""
        started = self._pending.holding()
        # The data plane writes into the callers' tensors outside autograd, as
        # Horovod's C++ does: an in-place collective on a leaf that requires
        # grad (``hvd.allreduce_(w)``) is not an in-place operation autograd
        # may refuse. Grad mode is per thread: the engine's own threads keep it
        # off, and a waited-on call runs its round on the caller's thread.
        grad_mode = torch.is_grad_enabled()
        if grad_mode:
            _set_grad_enabled(False)  # (what torch.set_grad_enabled calls, a third of its cost)
        try:
            work()
        except BackendError as exc:
            self._pending.fail(HorovodInternalError(
                f"data plane failed on rank {self.rank} running {list(names)[:3]}: {exc}"))
        except HoraError as exc:
            self._pending.fail(exc)
        except Exception as exc:  # noqa: BLE001 - a bug must fail handles, not hang them
            log.exception("rank %d: executing %s failed", self.rank, list(names)[:3])
            self._pending.fail(HorovodInternalError(f"internal error on rank {self.rank}: {exc}"))
        except BaseException as exc:  # KeyboardInterrupt, SystemExit: fail what we hold, go on
            self._pending.fail(HorovodInternalError(
                f"rank {self.rank}: a round was interrupted ({exc!r}); this generation "
                f"cannot run further collectives"))
            raise
        finally:
            if grad_mode:
                _set_grad_enabled(True)
            if started:
                self._pending.release()

    def run_list(self, responses: Sequence[negotiation_pb2.Response]) -> None:
        """Runs a non-global set's response list, in order (outside
        ``torch.inference_mode()``, as the agreement's rounds run: what the engine
        makes, fusion buffers and outputs, are normal tensors)."""
        with torch.inference_mode(False):
            for response in responses:
                self.run_safely(response.tensor_names, functools.partial(self._run, response))

    def _run(self, response: negotiation_pb2.Response) -> None:
        self.execute(response)

    # -- responses --------------------------------------------------------------

    def execute(self, response: negotiation_pb2.Response) -> list[Entry]:
        """Runs one collective or error response; returns the local entries it completed.

        (Join responses belong to the agreement rounds, which handle them.)
        """
        entries = self._pending.take(response.tensor_names)
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
        op = RESPONSE_OP[response.type]
        group = self.sets.get(response.process_set_id)
        backend = self.sets.backend(entries[0].buffer.device.type, group)
        if op != OpType.ALLREDUCE:
            self.activity([e.name for e in entries], "QUEUE",
                          f"{backend.name.upper()}_{op.name}")
        if op == OpType.ALLREDUCE:
            # The same backend a cached round would pick for these tensors.
            self.allreduce(self._selector.for_entries(entries, group), entries, group.size)
        elif op == OpType.ALLGATHER:
            self._allgather(backend, entries, response.first_dims, group.size)
        elif op == OpType.BROADCAST:
            entry = entries[0]
            backend.broadcast(entry.buffer, group.ranks.index(entry.root_rank))
            self.finish(entry, entry.buffer)
        elif op == OpType.ALLTOALL:
            self._alltoall(backend, entries[0], response.splits, group)
        elif op == OpType.REDUCESCATTER:
            self._reducescatter(backend, entries[0], group)
        elif op == OpType.BARRIER:
            backend.barrier()
            self.finish(entries[0], None)
        return entries

    def finish(self, entry: Entry, value: Any) -> None:
        self._timeline.current.end(entry.name)
        self._hand_back(entry, value)

    def _hand_back(self, entry: Entry, value: Any) -> None:
        """Completes ``entry``'s handle with what its collective produced."""
        if entry.result is None:
            entry.handle.set_result(value)
            return
        try:
            result = entry.result(value)
        except Exception as exc:  # noqa: BLE001 - the handle's error, not the world's
            entry.handle.set_error(self._unwritten(entry, exc))
            return
        entry.handle.set_result(result)

    def _unwritten(self, entry: Entry, exc: Exception) -> InvalidCallError:
        """The error of a collective that completed on every rank, whose result
        this rank could not hand back (writing into the caller's tensor
        failed): that call fails, and the world goes on, as after an invalid call."""
        log.warning("rank %d: %r completed, but its result could not be handed back: %s",
                    self.rank, entry.name, exc)
        return InvalidCallError(f"tensor {entry.name!r}: the collective completed, but rank "
                                f"{self.rank} could not write its result back: {exc}")

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
                buffer = torch.full(tuple(meta.shape), identity(op, dtype), dtype=dtype,
                                    device=meta.device or "cpu")
                entry = Entry(name=name, op_type=OpType.ALLREDUCE, buffer=buffer,
                              handle=Handle(name), reduce_op=op,
                              prescale_factor=meta.prescale_factor,
                              postscale_factor=meta.postscale_factor,
                              process_set_id=meta.process_set_id)
            filled.append(entry)
        return filled

    # -- collectives ------------------------------------------------------------

    def fusion_buffer(self, dtype: torch.dtype, device: torch.device, numel: int,
                      process_set_id: int = 0) -> torch.Tensor:
        """A buffer of ``numel`` elements for one fused batch of ``process_set_id``.

        Each set has its own: a set's responses run on the set's thread
        (:class:`.process_sets.ProcessSets`) while the global set's rounds run.
        """
        key = (dtype, device, process_set_id)
        buf = self._fusion_buffers.get(key)
        if buf is None or buf.numel() < numel:
            # Grow geometrically so a slowly growing model does not reallocate every step.
            size = max(numel, 2 * buf.numel() if buf is not None else 0)
            buf = torch.empty(size, dtype=dtype, device=device)
            self._fusion_buffers[key] = buf
            self._placed.clear()  # they would keep the old buffer alive
        return buf[:numel]

    def _fused(self, buffers: list[torch.Tensor], layout: object, process_set_id: int
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The fusion buffer for ``buffers`` (one dtype and device, contiguous),
        and a view of it shaped as each, back to back. ``layout``, when not
        None, stands for the buffers' shapes (equal layouts, equal shapes)."""
        first = buffers[0]
        dtype, itemsize = first.dtype, first.element_size()

        def place() -> Placement:
            placed, offset = [], 0
            for b in buffers:
                shape = b.shape
                placed.append((offset, dtype, shape))
                offset += shape.numel() * itemsize
            return placed, buffers

        if layout is None:  # the placements themselves are the key
            placement = place()
            layout, place = tuple(placement[0]), lambda: placement
        buf = self.fusion_buffer(dtype, first.device, sum([b.numel() for b in buffers]),
                                 process_set_id)
        return buf, self._placed.get(buf, layout, place)

    def allreduce(self, backend: Reducer, entries: list[Entry], set_size: int,
                  layout: object = None) -> None:
        """Allreduces ``entries`` (one fusion batch) on ``backend`` and completes them.

        ``layout``, when not None, stands for the entries' shapes: batches with
        equal layouts have tensors of equal shapes, in the same order.
        """
        first = entries[0]
        names = [e.name for e in entries]
        self.activity(names, "QUEUE", None)
        reads_input = backend.reads_input
        views: list[torch.Tensor] = []
        if len(entries) == 1:
            buf = first.buffer
        else:
            buffers = [e.buffer for e in entries]
            buf, views = self._fused(buffers, layout, first.process_set_id)
            if reads_input:
                self.activity(names, None, "MEMCPY_IN_FUSION_BUFFER")
                if all(b.dim() == 1 for b in buffers):
                    torch.cat(buffers, out=buf)  # one kernel: the cheapest for 1-D
                else:
                    torch._foreach_copy_(views, buffers)
                self.activity(names, "MEMCPY_IN_FUSION_BUFFER", None)
        activity = f"{backend.name.upper()}_ALLREDUCE"
        self.activity(names, None, activity)
        if reads_input:
            scale_(buf, first.prescale_factor)
        backend.allreduce(buf, _NATIVE_REDUCE[first.reduce_op])
        scale_(buf, post_factor(first, set_size, carried=not reads_input))
        self.activity(names, activity, None)
        if len(entries) == 1:
            self.finish(first, buf)
            return
        self.activity(names, None, "MEMCPY_OUT_FUSION_BUFFER")
        torch._foreach_copy_([entry.buffer for entry in entries], views)
        self.activity(names, "MEMCPY_OUT_FUSION_BUFFER", None)
        self.finish_all(entries)

    def finish_all(self, entries: list[Entry]) -> None:
        """:meth:`finish` with each entry's buffer, the handles completed together."""
        timeline = self._timeline.current
        if timeline.active:
            for entry in entries:
                timeline.end(entry.name)
        try:
            results = [entry.result(entry.buffer) if entry.result else entry.buffer
                       for entry in entries]
        except Exception:  # noqa: BLE001 - one caller's tensor: see ``finish``
            for entry in entries:  # (handing a result back again writes the same values)
                self._hand_back(entry, entry.buffer)
            return
        Handle.set_results([entry.handle for entry in entries], results)

    def activity(self, names: list[str], end: str | None, start: str | None) -> None:
        timeline = self._timeline.current
        if not timeline.active:
            return
        for name in names:
            if end is not None:
                timeline.activity_end(name)
            if start is not None:
                timeline.activity_start(name, start)

    def _allgather(self, backend: Backend, entries: list[Entry], first_dims: Sequence[int],
                   set_size: int) -> None:
        for i, entry in enumerate(entries):
            counts = list(first_dims[i * set_size:(i + 1) * set_size])
            tensor = entry.buffer
            output = tensor.new_empty((sum(counts),) + tuple(tensor.shape[1:]))
            backend.allgatherv(output, tensor, counts)
            self.finish(entry, output)

    def _alltoall(self, backend: Backend, entry: Entry, matrix: Sequence[int],
                  group: SetGroup) -> None:
        me, set_size = group.index, group.size
        assert me is not None
        send = [int(matrix[me * set_size + s]) for s in range(set_size)]
        recv = [int(matrix[r * set_size + me]) for r in range(set_size)]
        tensor = entry.buffer
        output = tensor.new_empty((sum(recv),) + tuple(tensor.shape[1:]))
        backend.alltoallv(output, tensor, recv, send)
        self.finish(entry, (output, torch.tensor(recv, dtype=torch.int32)))

    def _reducescatter(self, backend: Backend, entry: Entry, group: SetGroup) -> None:
        assert group.index is not None
        set_size = group.size
        tensor = entry.buffer
        counts = split_rows(tensor.shape[0], set_size)
        scale_(tensor, entry.prescale_factor)
        output = tensor.new_empty((counts[group.index],) + tuple(tensor.shape[1:]))
        backend.reducescatter(output, tensor, _NATIVE_REDUCE[entry.reduce_op], counts)
        scale_(output, post_factor(entry, set_size))
        self.finish(entry, output)
