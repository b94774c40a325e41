"""Chooses and builds a backend for a device, importing each one lazily.

``import hora.torch`` imports this module but none of the backends: NCCL
and XCCL (oneCCL) are imported only when a tensor on their device arrives.
"""

from __future__ import annotations

import importlib
import logging
from datetime import timedelta

import torch

from .base import Backend, BackendError

log = logging.getLogger("hora")

__all__ = ["BACKENDS", "available", "backend_for_device", "create_backend", "xccl_built"]

# Backend name -> (module, class, device types it serves).
BACKENDS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "gloo": ("hora_native.gloo", "GlooBackend", ("cpu",)),
    "nccl": ("hora_native.nccl", "NcclBackend", ("cuda",)),
    "xccl": ("hora_native.xccl", "XcclBackend", ("xpu",)),
}


def backend_for_device(device_type: str) -> str:
    """Names the backend that runs collectives for tensors on ``device_type``.

    Raises:
        BackendError: no backend serves that kind of device.
    """
    for name, (_module, _class, devices) in BACKENDS.items():
        if device_type in devices:
            return name
    raise BackendError(f"no hora backend for tensors on device type {device_type!r}")


def available(name: str) -> bool:
    """Whether backend ``name`` can run in this process."""
    if name == "gloo":
        return torch.distributed.is_available() and torch.distributed.is_gloo_available()
    if name == "nccl":
        return (torch.distributed.is_available() and torch.distributed.is_nccl_available()
                and torch.cuda.is_available())
    if name == "xccl":
        return xccl_built() and torch.xpu.is_available()
    return False


def xccl_built() -> bool:
    """Whether this torch build has the XCCL process group (torch for Intel GPUs)."""
    dist = torch.distributed
    return (dist.is_available() and getattr(dist, "is_xccl_available", lambda: False)()
            and hasattr(dist, "ProcessGroupXCCL"))


def create_backend(name: str, store: torch.distributed.Store, rank: int, size: int,
                   timeout: timedelta, address: str) -> Backend:
    """Builds backend ``name``; every rank of the group must call this together."""
    try:
        module_name, class_name, _ = BACKENDS[name]
    except KeyError:
        raise BackendError(f"unknown backend {name!r}; known: {sorted(BACKENDS)}") from None
    if not available(name):
        raise BackendError(f"backend {name!r} is not available in this process")
    if name == "nccl" and size > 1:
        staged = _staged_if_sharing(store, rank, size, timeout, address)
        if staged is not None:
            return staged
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(store, rank, size, timeout, address)


def _staged_if_sharing(store: torch.distributed.Store, rank: int, size: int,
                       timeout: timedelta, address: str) -> Backend | None:
    """A host-staged CUDA backend when ranks of the group share a GPU (NCCL refuses that)."""
    from .gloo import GlooBackend
    from .staged import HostStagedBackend, shared_devices

    shared = shared_devices(store, rank, size)
    if not shared:
        return None
    if rank == 0:
        groups = "; ".join(f"ranks {ranks} on {device}" for device, ranks in shared.items())
        log.warning("NCCL cannot run two ranks on one GPU (%s): CUDA tensors go through "
                    "host memory and Gloo instead, two copies per collective", groups)
    inner = GlooBackend(torch.distributed.PrefixStore("staged/", store), rank, size, timeout,
                        address)
    return HostStagedBackend(inner)
