"""What the Gloo and NCCL backends share: collectives over a torch.distributed process group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .base import BackendError, ReduceKind

__all__ = ["ProcessGroupBackend", "as_rows_of_bytes"]

_OPS: dict[ReduceKind, Any] = {
    ReduceKind.SUM: dist.ReduceOp.SUM,
    ReduceKind.MIN: dist.ReduceOp.MIN,
    ReduceKind.MAX: dist.ReduceOp.MAX,
    ReduceKind.PRODUCT: dist.ReduceOp.PRODUCT,
}


def as_rows_of_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor seen as a 2-D uint8 tensor with the same first dimension.

    Collectives that only move data (broadcast, allgather, alltoall) run on
    this view, so they never depend on the library knowing the dtype (Gloo
    has no int16, neither library has complex); the bytes land in the
    caller's tensor. An empty tensor may have any strides (numpy hands over
    zero strides for a TF tensor with no elements), which no byte view takes:
    it gets a new empty tensor of the same rows, as no bytes land anyway.
    """
    rows = tensor.shape[0] if tensor.dim() else 1
    row_bytes = tensor.element_size()
    for extent in tensor.shape[1:]:
        row_bytes *= extent
    if tensor.numel() == 0:
        return torch.empty((rows, row_bytes), dtype=torch.uint8, device=tensor.device)
    return tensor.reshape(-1).view(torch.uint8).view(rows, row_bytes)


class ProcessGroupBackend:
    """The backend interface over one process group built by a subclass.

    Subclasses set ``name``, build ``self._pg`` in ``__init__``, and may
    override :meth:`_wait` (NCCL also waits for its stream) and
    ``reduce_dtypes`` (the element types the library reduces itself; others
    are reduced in a wider type, see :meth:`_wider`).
    """

    name = "process-group"
    reads_input = True
    reduce_dtypes: frozenset[torch.dtype] = frozenset({
        torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
        torch.float32, torch.float64})

    def __init__(self, pg: Any, rank: int, size: int) -> None:
        self._pg = pg
        self.rank = rank
        self.size = size

    @property
    def pg(self) -> Any:
        if self._pg is None:
            raise BackendError(f"{self.name}: the process group is closed")
        return self._pg

    def _wait(self, work: dist.Work) -> None:
        work.wait()

    def _run(self, what: str, work: dist.Work) -> None:
        try:
            self._wait(work)
        except RuntimeError as exc:
            raise BackendError(f"{self.name} {what} failed on rank {self.rank}: {exc}") from exc

    def _wider(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A copy of ``tensor`` in a type the library reduces, or None when it reduces
        ``tensor``'s own type. Integers widen to int32 (the sum wraps around when
        narrowed back, as it would in the narrow type)."""
        if tensor.dtype in self.reduce_dtypes:
            return None
        if tensor.is_floating_point():
            return tensor.to(torch.float64)
        return tensor.to(torch.int32 if tensor.element_size() < 4 else torch.int64)

    def allreduce(self, tensor: torch.Tensor, op: ReduceKind) -> None:
        if tensor.numel() == 0:
            return  # the same shape on every rank (negotiated): nothing to reduce anywhere
        if tensor.dtype == torch.bool:
            # Logical reductions on the bytes: a sum is an or, a product an and.
            op = {ReduceKind.SUM: ReduceKind.MAX, ReduceKind.PRODUCT: ReduceKind.MIN}.get(op, op)
            tensor = tensor.view(torch.uint8)
        wide = self._wider(tensor)
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[op]
        self._run("allreduce", self.pg.allreduce([tensor if wide is None else wide], opts))
        if wide is not None:
            tensor.copy_(wide)

    def allgatherv(self, output: torch.Tensor, tensor: torch.Tensor,
                   counts: Sequence[int]) -> None:
        # all_to_all with each rank sending its whole tensor to every rank
        # handles ragged first dimensions without padding, and Gloo's
        # all_to_all runs about 3x faster than its all_gather here.
        rows = tensor.shape[0]
        send = torch.cat([tensor] * self.size) if self.size > 1 else tensor
        self.alltoallv(output, send, list(counts), [rows] * self.size)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        self._run("broadcast", self.pg.broadcast([as_rows_of_bytes(tensor)], opts))

    def alltoallv(self, output: torch.Tensor, tensor: torch.Tensor,
                  output_splits: Sequence[int], input_splits: Sequence[int]) -> None:
        self._run("alltoall", self.pg.alltoall_base(
            as_rows_of_bytes(output), as_rows_of_bytes(tensor), list(output_splits),
            list(input_splits), dist.AllToAllOptions()))

    def reducescatter(self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceKind,
                      counts: Sequence[int]) -> None:
        if len(set(counts)) == 1 and self._wider(tensor) is None:
            chunks = list(tensor.split(list(counts)))
            opts = dist.ReduceScatterOptions()
            opts.reduceOp = _OPS[op]
            self._run("reducescatter", self.pg.reduce_scatter([output], [chunks], opts))
            return
        # Uneven splits: the libraries want equal chunks, so reduce the whole
        # tensor and keep this rank's rows.
        work = tensor.clone()
        self.allreduce(work, op)
        start = sum(counts[: self.rank])
        output.copy_(work.narrow(0, start, counts[self.rank]))

    def barrier(self) -> None:
        self._run("barrier", self.pg.barrier(dist.BarrierOptions()))

    def close(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except RuntimeError:
                pass  # a group whose peers are gone cannot shut down cleanly
