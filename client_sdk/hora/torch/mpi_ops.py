"""Collectives on torch tensors, with Horovod's signatures and semantics.

Horovod's ``horovod.torch.mpi_ops`` under hora: the world and handles live
in :mod:`._basics`, the collectives in :mod:`._collectives` and their
differentiable forms in :mod:`._autograd`. Every ``*_async`` function returns an integer handle;
:func:`synchronize` waits for it and returns the result, :func:`poll` asks
whether it is done. The synchronous forms are differentiable where
Horovod's are.
"""

from __future__ import annotations

from .._ops import ReduceOp  # noqa: F401 - the type of hvd.Average and friends
from ._autograd import *  # noqa: F403
from ._autograd import __all__ as _autograd_all
from ._basics import *  # noqa: F403
from ._basics import __all__ as _basics_all
from ._collectives import *  # noqa: F403
from ._collectives import __all__ as _collectives_all

__all__ = [*_basics_all, *_collectives_all, *_autograd_all]
