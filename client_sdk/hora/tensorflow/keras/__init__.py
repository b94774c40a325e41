"""hora.tensorflow.keras: Horovod's Keras API on hora. ``import hora.tensorflow.keras as hvd``.

Works with Keras 3 (``tf.keras`` in TensorFlow 2.16+) and with the legacy
Keras 2 (``tf-keras``, selected by ``TF_USE_LEGACY_KERAS=1``): whichever
``tf.keras`` is.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ...errors import HorovodInternalError, HostsUpdatedInterrupt, InvalidCallError
from .. import mpi_ops as _mpi_ops
from .._gradients import GradientReducer
from ..compression import Compression
from ..functions import allgather_object, broadcast_object, broadcast_variables
from ..mpi_ops import *  # noqa: F403
from ..mpi_ops import Average, ProcessSet, global_process_set
from . import callbacks, elastic
from ._optimizer import distributed_class, is_distributed, make_distributed

__all__ = [*_mpi_ops.__all__, "Compression", "DistributedOptimizer", "HorovodInternalError",
           "HostsUpdatedInterrupt", "InvalidCallError", "allgather_object",
           "broadcast_global_variables", "broadcast_object", "broadcast_variables",
           "callbacks", "elastic", "load_model"]


def DistributedOptimizer(optimizer: Any, name: str | None = None,  # noqa: N802
                         device_dense: str = "", device_sparse: str = "",
                         compression: Any = Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: Any = Average,
                         backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """A copy of the Keras ``optimizer`` (same class and config) that averages the
    gradients over the ranks before applying them: one grouped allreduce per step.

    With legacy Keras, compile the model with ``experimental_run_tf_function=False``
    as Horovod's walk-through does (accepted, not required).

    ``backward_passes_per_step=N`` (Keras 3): gradients accumulate locally for N steps
    and are reduced once, when the optimizer applies them; summed, or averaged with
    ``average_aggregated_gradients=True``.
    """
    del name, device_dense, device_sparse, scale_local_gradients
    reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                              num_groups, groups, process_set)
    if backward_passes_per_step > 1 and not average_aggregated_gradients:
        # Keras averages what it accumulated; Horovod's default sums it.
        reducer.post *= backward_passes_per_step
    return make_distributed(optimizer, reducer, in_place=False,
                            backward_passes_per_step=backward_passes_per_step)


def broadcast_global_variables(root_rank: int) -> Any:
    """An op that broadcasts TF1's global variables from ``root_rank`` (graph mode only).

    Raises:
        RuntimeError: in eager mode, as in Horovod: TensorFlow 2 has no global
            variables; broadcast the model's variables instead.
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution (TensorFlow 2 "
            "has no global variables); use hvd.broadcast_variables(model.variables, root_rank) "
            "or hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def load_model(filepath: Any, custom_optimizers: Any = None, custom_objects: Any = None,
               compression: Any = Compression.none, **kwargs: Any) -> Any:
    """``tf.keras.models.load_model``, with the loaded optimizer made a DistributedOptimizer
    (its state kept)."""
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects[cls.__name__] = cls
    model = tf.keras.models.load_model(filepath, custom_objects=objects or None, **kwargs)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not is_distributed(optimizer):
        make_distributed(optimizer, GradientReducer(compression), in_place=True)
    return model


_ = distributed_class
