"""XCCL: the Intel GPU (XPU) data plane, through torch.distributed's ProcessGroupXCCL.

Imported only when an XPU tensor reaches the engine. torch builds with XPU
support ship this process group; like NCCL it runs on the device's queue,
so each collective waits for the device before returning.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ._pg import ProcessGroupBackend
from .base import BackendError

__all__ = ["XcclBackend"]


class XcclBackend(ProcessGroupBackend):
    """Collectives on XPU tensors over an XCCL process group."""

    name = "xccl"
    # oneCCL reduces the same element types as NCCL; int16 and bool are widened.

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 address: str = "127.0.0.1") -> None:
        del address  # oneCCL finds its own interfaces
        pg_class = getattr(dist, "ProcessGroupXCCL", None)
        if pg_class is None or not dist.is_xccl_available():
            raise BackendError("xccl: this torch build has no XCCL (it needs torch for XPU)")
        opts = pg_class.Options() if hasattr(pg_class, "Options") else None
        if opts is not None and hasattr(opts, "_timeout"):
            opts._timeout = timeout
        pg = pg_class(store, rank, size, opts) if opts is not None else \
            pg_class(store, rank, size)
        super().__init__(pg, rank, size)

    def _wait(self, work: dist.Work) -> None:
        work.wait()
        torch.xpu.synchronize()
