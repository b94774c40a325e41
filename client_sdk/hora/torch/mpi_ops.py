"""Collectives on torch tensors, with Horovod's signatures and semantics.

Horovod's ``horovod.torch.mpi_ops`` under hora: the world and handles live
in :mod:`hora.world`, the collectives in :mod:`._collectives` and their
differentiable forms in :mod:`._autograd`. Every ``*_async`` function returns an integer handle
(``sparse_allreduce_async`` excepted, as in Horovod: it returns a function);
:func:`synchronize` waits for it and returns the result, :func:`poll` asks
whether it is done. The synchronous forms are differentiable where
Horovod's are.
"""

from __future__ import annotations

import torch

from .._ops import ReduceOp  # noqa: F401 - the type of hvd.Average and friends
from ..world import *  # noqa: F403
from ..world import CallableHandle, ProcessSet, global_process_set
from ..world import __all__ as _basics_all
from ..world import poll as _poll
from ..world import synchronize as _synchronize
from . import _collectives
from ._autograd import *  # noqa: F403
from ._autograd import __all__ as _autograd_all
from ._collectives import *  # noqa: F403
from ._collectives import __all__ as _collectives_all

__all__ = [*_basics_all, *_collectives_all, *_autograd_all]


# Replaces the star-imported form, whose integer handle Horovod's scripts cannot call.
def sparse_allreduce_async(  # type: ignore[no-redef]
        tensor: torch.Tensor, name: str | None = None,
        op: ReduceOp | None = None,
        process_set: ProcessSet = global_process_set) -> CallableHandle:
    """Starts summing (or averaging) a sparse tensor over the ranks of ``process_set``.

    As in Horovod, every rank's indices and values are allgathered (as
    ``<name>.indices`` and ``<name>.values``) and the result is a sparse COO
    tensor holding every rank's entries, not coalesced.

    Returns:
        A function (Horovod's contract): ``handle()`` waits and returns the
        reduced sparse tensor. :func:`synchronize` and :func:`poll` take it too.
    """
    handle = _collectives.sparse_allreduce_async(tensor, name, op, process_set)
    return CallableHandle(lambda: _synchronize(handle), lambda: _poll(handle))
