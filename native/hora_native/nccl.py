"""NCCL: the CUDA data plane, through torch.distributed's ProcessGroupNCCL.

Imported only when a CUDA tensor reaches the engine. Kept deliberately
small: it maps the backend interface onto ProcessGroupNCCL and runs each
collective on the group's stream, waiting for it before returning so that
the engine's ordering guarantees hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from .base import BackendError, ReduceKind

__all__ = ["NcclBackend"]

_OPS = {
    ReduceKind.SUM: dist.ReduceOp.SUM,
    ReduceKind.MIN: dist.ReduceOp.MIN,
    ReduceKind.MAX: dist.ReduceOp.MAX,
    ReduceKind.PRODUCT: dist.ReduceOp.PRODUCT,
}


class NcclBackend:
    """Collectives on CUDA tensors over an NCCL process group."""

    name = "nccl"

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 address: str = "127.0.0.1") -> None:
        del address  # NCCL finds its own interfaces
        if not dist.is_nccl_available():
            raise BackendError("nccl: this torch build has no NCCL")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        self.rank = rank
        self.size = size
        self._pg: dist.ProcessGroupNCCL | None = dist.ProcessGroupNCCL(store, rank, size, opts)

    @property
    def pg(self) -> dist.ProcessGroupNCCL:
        if self._pg is None:
            raise BackendError("nccl: the process group is closed")
        return self._pg

    def _run(self, what: str, work: dist.Work) -> None:
        try:
            work.wait()
            torch.cuda.current_stream().synchronize()
        except RuntimeError as exc:
            raise BackendError(f"nccl {what} failed on rank {self.rank}: {exc}") from exc

    def allreduce(self, tensor: torch.Tensor, op: ReduceKind) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[op]
        self._run("allreduce", self.pg.allreduce([tensor], opts))

    def allgatherv(self, output: torch.Tensor, tensor: torch.Tensor,
                   counts: Sequence[int]) -> None:
        rows = tensor.shape[0]
        send = torch.cat([tensor] * self.size)
        self.alltoallv(output, send, list(counts), [rows] * self.size)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        self._run("broadcast", self.pg.broadcast([tensor], opts))

    def alltoallv(self, output: torch.Tensor, tensor: torch.Tensor,
                  output_splits: Sequence[int], input_splits: Sequence[int]) -> None:
        self._run("alltoall", self.pg.alltoall_base(
            output, tensor, list(output_splits), list(input_splits), dist.AllToAllOptions()))

    def reducescatter(self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceKind,
                      counts: Sequence[int]) -> None:
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
                pass
