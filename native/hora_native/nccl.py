"""NCCL: the CUDA data plane, through torch.distributed's ProcessGroupNCCL.

Imported only when a CUDA tensor reaches the engine. Kept deliberately
small: the shared process-group backend does the work; NCCL only adds
waiting for the group's stream before returning, so that the engine's
ordering guarantees hold.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ._pg import ProcessGroupBackend
from .base import BackendError

__all__ = ["NcclBackend"]


class NcclBackend(ProcessGroupBackend):
    """Collectives on CUDA tensors over an NCCL process group."""

    name = "nccl"

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 address: str = "127.0.0.1") -> None:
        del address  # NCCL finds its own interfaces
        if not dist.is_nccl_available():
            raise BackendError("nccl: this torch build has no NCCL")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        super().__init__(dist.ProcessGroupNCCL(store, rank, size, opts), rank, size)

    def _wait(self, work: dist.Work) -> None:
        work.wait()
        torch.cuda.current_stream().synchronize()
