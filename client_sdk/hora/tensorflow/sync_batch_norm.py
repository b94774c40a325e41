"""``hvd.SyncBatchNormalization``: batch normalization over the batches of every rank."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from .mpi_ops import ProcessSet, Sum, global_process_set, grouped_allreduce

__all__ = ["SyncBatchNormalization"]


def _global_moments(inputs: Any, axes: Any, keepdims: bool,
                    process_set: ProcessSet) -> tuple[Any, Any]:
    """Mean and variance over ``axes`` of every rank's ``inputs`` together.

    One grouped allreduce of the element count, the sum and the sum of squares
    (differentiable: the allreduce's gradient is the allreduce of the gradient).
    """
    axes = [a % inputs.shape.rank for a in axes]
    shape = tf.shape(inputs)
    count = tf.cast(tf.reduce_prod(tf.gather(shape, axes)), inputs.dtype)
    total, sums, squares = grouped_allreduce(
        [tf.reshape(count, [1]), tf.reduce_sum(inputs, axes, keepdims=keepdims),
         tf.reduce_sum(tf.square(inputs), axes, keepdims=keepdims)],
        op=Sum, process_set=process_set)
    mean = sums / total[0]
    variance = tf.maximum(squares / total[0] - tf.square(mean), 0.0)
    return mean, variance


class SyncBatchNormalization(tf.keras.layers.BatchNormalization):
    """A Keras ``BatchNormalization`` whose training-time statistics are those of the
    global batch (every rank's batch together), for Keras 3 and for tf-keras.

    Args:
        process_set: the ranks whose batches are normalised together.
        **kwargs: ``BatchNormalization``'s arguments.
    """

    def __init__(self, *args: Any, process_set: ProcessSet = global_process_set,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hora_process_set = process_set

    # Keras 3 asks _moments(inputs, mask) for the batch's statistics; tf-keras's
    # _moments(inputs, axes, keep_dims, mask=...) goes on to _calculate_mean_and_var.
    def _moments(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) != 1 or kwargs:
            return super()._moments(inputs, *args, **kwargs)
        (mask,) = args
        if mask is not None:
            raise NotImplementedError("SyncBatchNormalization does not take masks")
        return _global_moments(inputs, list(self._reduction_axes), False,
                               self._hora_process_set)

    # tf-keras asks this one.
    def _calculate_mean_and_var(self, inputs: Any, reduction_axes: Any, keep_dims: bool,
                                mask: Any = None) -> Any:
        if mask is not None:
            raise NotImplementedError("SyncBatchNormalization does not take masks")
        return _global_moments(inputs, list(reduction_axes), keep_dims,
                               self._hora_process_set)
