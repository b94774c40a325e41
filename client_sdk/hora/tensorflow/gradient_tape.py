"""``hvd.DistributedGradientTape``: a GradientTape whose gradients are averaged over ranks."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ._gradients import GradientReducer
from .compression import Compression
from .mpi_ops import Average, ProcessSet, global_process_set

__all__ = ["DistributedGradientTape"]


class _DistributedGradientTape(tf.GradientTape):
    _hora_reducer: GradientReducer

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 **kwargs: Any) -> Any:
        grads = super().gradient(target, sources, output_gradients, **kwargs)
        flat = tf.nest.flatten(grads, expand_composites=False)
        reduced = self._hora_reducer.reduce(flat, tf.nest.flatten(sources))
        return tf.nest.pack_sequence_as(grads, reduced)


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",  # noqa: N802
                            device_sparse: str = "", compression: Any = Compression.none,
                            sparse_as_dense: bool = False, op: Any = Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Any = None, process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True) -> tf.GradientTape:
    """Wraps a recorded ``tf.GradientTape``: ``gradient()`` returns averaged gradients.

        with tf.GradientTape() as tape:
            loss = ...
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)

    The gradients go out in one grouped allreduce (``num_groups``/``groups``
    split it), so that eager and ``tf.function`` steps cost one negotiation.
    """
    del device_dense, device_sparse, scale_local_gradients
    tape = object.__new__(_DistributedGradientTape)
    tape.__dict__.update(gradtape.__dict__)
    tape._hora_reducer = GradientReducer(compression, sparse_as_dense, op,
                                         gradient_predivide_factor, num_groups, groups,
                                         process_set)
    return tape
