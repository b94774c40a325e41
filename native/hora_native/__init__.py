"""hora's data plane: adapters from one backend interface to native collective libraries."""

from .base import Backend, BackendError, PlacedViews, ReduceKind, Reducer, RegionViews, scale_
from .registry import available, backend_for_device, create_backend, xccl_built

__all__ = ["Backend", "BackendError", "PlacedViews", "ReduceKind", "Reducer", "RegionViews",
           "available", "scale_", "backend_for_device",
           "create_backend", "xccl_built"]
