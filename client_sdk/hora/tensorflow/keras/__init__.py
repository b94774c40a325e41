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
           "PartialDistributedOptimizer",
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

    ``backward_passes_per_step=N``: gradients accumulate locally for N steps and are
    reduced once, when the optimizer applies them; summed, or averaged with
    ``average_aggregated_gradients=True``.

    ``optimizer.register_local_var(var)`` keeps a variable's gradient on its rank
    (divided by the set's size when ``scale_local_gradients``); see
    :func:`PartialDistributedOptimizer`.
    """
    del name, device_dense, device_sparse
    reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                              num_groups, groups, process_set, scale_local_gradients)
    return make_distributed(optimizer, reducer, in_place=False,
                            backward_passes_per_step=backward_passes_per_step,
                            average_aggregated_gradients=average_aggregated_gradients)


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None,  # noqa: N802
                                device_dense: str = "", device_sparse: str = "",
                                compression: Any = Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: Any = Average,
                                backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False,
                                groups: Any = None, process_set: ProcessSet = global_process_set,
                                local_layers: Any = None,
                                scale_local_gradients: bool = True) -> Any:
    """A :func:`DistributedOptimizer` that leaves the gradients of ``local_layers`` (a Keras
    layer or a list of them) on each rank: not averaged, only divided by the set's size
    when ``scale_local_gradients``.

    Raises:
        ValueError: ``local_layers`` holds something that is not a Keras layer.
    """
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, tf.keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, tf.keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    distributed = DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
    for layer in local_layers:
        for variable in layer.trainable_weights:
            distributed.register_local_var(variable)
    return distributed


# Horovod's Keras API replaces TensorFlow's allreduce and reducescatter (imported above).
def allreduce(value: Any, name: str | None = None,  # type: ignore[no-redef]
              average: bool | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: Any = None,
              compression: Any = Compression.none,
              process_set: ProcessSet = global_process_set) -> Any:
    """Horovod's Keras ``allreduce``: a tensor-compatible ``value`` (a number, an array, a
    tensor) reduced over the ranks, averaged unless ``op`` or ``average`` say otherwise.
    ``name`` comes second here, as in Horovod's Keras API (TensorFlow's takes ``average``)."""
    return _mpi_ops.allreduce(tf.convert_to_tensor(value), average=average,
                              compression=compression, op=op,
                              prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor, name=name,
                              process_set=process_set)


def reducescatter(value: Any, name: str | None = None, op: Any = Average,  # type: ignore[no-redef]
                  process_set: ProcessSet = global_process_set) -> Any:
    """Horovod's Keras ``reducescatter``: ``value`` reduced over the ranks, each rank
    keeping its share of the first dimension; ``name`` comes second, as in Horovod."""
    return _mpi_ops.reducescatter(tf.convert_to_tensor(value), op=op, name=name,
                                  process_set=process_set)


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
