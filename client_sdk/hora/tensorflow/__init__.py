"""hora.tensorflow: Horovod's TensorFlow API on hora. ``import hora.tensorflow as hvd``.

The collectives run on hora's engine (the one :mod:`hora.torch` uses), in
eager mode and inside ``tf.function``, with Horovod's gradients.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ..errors import HorovodInternalError, HostsUpdatedInterrupt, InvalidCallError
from . import elastic
from . import mpi_ops as _mpi_ops
from ._aggregation import LocalAggregator
from ._gradients import GradientReducer
from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_object_fn, broadcast_variables
from .gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from .mpi_ops import *  # noqa: F403
from .mpi_ops import Average, ProcessSet, global_process_set
from .sync_batch_norm import SyncBatchNormalization

__all__ = [*_mpi_ops.__all__, "Compression", "DistributedGradientTape", "DistributedOptimizer",
           "PartialDistributedGradientTape", "SyncBatchNormalization",
           "HorovodInternalError", "HostsUpdatedInterrupt", "InvalidCallError",
           "allgather_object", "broadcast_global_variables", "broadcast_object",
           "broadcast_object_fn", "broadcast_variables", "elastic"]


class _DistributedV1Optimizer(tf.compat.v1.train.Optimizer):
    """A ``tf.compat.v1.train.Optimizer`` whose gradients are averaged over the ranks.

    With an aggregator (``backward_passes_per_step > 1``), ``compute_gradients``
    adds to local sums and reduces them every N-th pass, and ``apply_gradients``
    applies only on that pass (on the others it counts ``global_step``).
    """

    def __init__(self, optimizer: Any, reducer: GradientReducer, name: str | None,
                 use_locking: bool, aggregator: LocalAggregator | None = None) -> None:
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}",
                         use_locking=use_locking)
        self._optimizer = optimizer
        self._reducer = reducer
        self._aggregator = aggregator

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if self._aggregator is not None:
            grads = self._aggregator.compute(grads, variables)
        else:
            grads = self._reducer.reduce(grads, variables)
        return list(zip(grads, variables, strict=True))

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None,
                        name: str | None = None) -> Any:
        if self._aggregator is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step, name)
        pairs = list(grads_and_vars)

        def apply() -> Any:
            return self._optimizer.apply_gradients(pairs, global_step, name)

        def skipped() -> Any:
            return global_step.assign_add(1) if global_step is not None else tf.no_op()

        return self._aggregator.apply(apply, skipped)

    def register_local_var(self, var: Any) -> None:
        """Keeps ``var``'s gradient on this rank (not averaged over the ranks)."""
        self._reducer.register_local_var(var)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer: Any, name: str | None = None,  # noqa: N802
                         use_locking: bool = False, device_dense: str = "",
                         device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                         op: Any = Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wraps an optimizer so that gradients are averaged over the ranks before applying.

    A Keras optimizer gets :func:`hora.tensorflow.keras.DistributedOptimizer`;
    a ``tf.compat.v1.train.Optimizer`` gets a wrapper whose
    ``compute_gradients`` allreduces. ``backward_passes_per_step=N`` sums the
    gradients of N passes on each rank (averages them with
    ``average_aggregated_gradients``) and reduces and applies them once.
    """
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                                  num_groups, groups, process_set, scale_local_gradients)
        aggregator = LocalAggregator(reducer, backward_passes_per_step,
                                     average_aggregated_gradients) \
            if backward_passes_per_step > 1 else None
        return _DistributedV1Optimizer(optimizer, reducer, name, use_locking, aggregator)
    from . import keras as _keras

    return _keras.DistributedOptimizer(
        optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)


def broadcast_global_variables(root_rank: int) -> Any:
    """An op broadcasting TF1's global variables from ``root_rank``; RuntimeError when eager."""
    from .keras import broadcast_global_variables as _broadcast

    return _broadcast(root_rank)
