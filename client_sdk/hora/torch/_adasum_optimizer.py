"""DistributedOptimizer(op=hvd.Adasum): each rank steps alone, then the updates
are combined by the Adasum rule."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..engine.telemetry import TELEMETRY
from ._adasum_rule import adasum_reduce
from ._parameters import _parameter_names
from .mpi_ops import ProcessSet, allgather_async, synchronize


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    """Adasum: each rank steps on its own gradient, then the deltas are Adasum-combined.

    This follows Horovod's Adasum optimizer: the update each rank would make
    alone is computed locally, and the ranks' updates are combined with the
    Adasum rule (which keeps the combined step size stable as ranks are
    added, so the learning rate need not be scaled by the world size).
    """

    def __init__(self, params: Any, named_parameters: Iterable[tuple[str, Any]] | None,
                 compression: Any, backward_passes_per_step: int, process_set: ProcessSet
                 ) -> None:
        # The user's optimizer class comes next in the dynamic class's MRO.
        super(self.__class__, self).__init__(params)  # type: ignore[call-arg]
        all_params = [p for group in self.param_groups for p in group["params"]]
        self._parameter_names = _parameter_names(self.param_groups, all_params, named_parameters)
        self._names = self._parameter_names
        self._compression = compression
        self._process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step

    def synchronize(self) -> None:
        """Nothing to wait for: Adasum combines updates inside ``step()``."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        yield

    def _local_step(self, closure: Any = None) -> Any:
        """The wrapped optimizer's update alone, with no collective."""
        return super(self.__class__, self).step(closure)

    def step(self, closure: Any = None) -> Any:

        params = [p for group in self.param_groups for p in group["params"]]
        starts = [p.detach().clone() for p in params]
        loss = super(self.__class__, self).step(closure)
        if self._process_set.size() > 1:
            with torch.no_grad():
                # Every delta is gathered at once, so that the ranks agree on
                # all of them in one round instead of one round per parameter.
                pending = []
                for p, start in zip(params, starts, strict=True):
                    wire, ctx = self._compression.compress(p - start)
                    handle = allgather_async(wire.reshape(1, -1), name=f"adasum.{self._names[p]}",
                                             process_set=self._process_set)
                    pending.append((p, start, wire.shape, ctx, handle))
                for p, start, shape, ctx, handle in pending:
                    rows = synchronize(handle)
                    combined = adasum_reduce(list(rows.unbind(0))).reshape(shape)
                    p.copy_(start + self._compression.decompress(combined, ctx))
        TELEMETRY.step()
        return loss
