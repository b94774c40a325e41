"""Elastic training for PyTorch: ``hvd.elastic.run``, ``TorchState``, ``ElasticSampler``.

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    train(state)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ... import _runtime
from ...elastic import State, run_fn
from ...errors import HorovodInternalError, HostsUpdatedInterrupt
from .sampler import ElasticSampler
from .state import ObjectState, TorchState

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState",
           "State", "TorchState", "run"]


def _reset() -> None:
    from .. import mpi_ops

    _runtime.shutdown(rejoin=True)
    mpi_ops.init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorates a training function ``func(state, ...)`` to survive world changes.

    On a failed collective the state is restored to its last commit; on a
    host change it is kept. Either way the worker re-joins the job, the state
    is synchronised from rank 0 and ``func`` is called again.
    """
    return run_fn(func, _reset, reset_limit=lambda: _runtime.current().settings.reset_limit,
                  on_failure=_runtime.abandon,
                  job_resets=lambda: max(0, _runtime.current().world.generation - 1))
