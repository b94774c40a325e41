"""``hvd.DistributedGradientTape``: a GradientTape whose gradients are averaged over ranks."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ._gradients import GradientReducer
from .compression import Compression
from .mpi_ops import Average, ProcessSet, global_process_set

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]


class _DistributedGradientTape(tf.GradientTape):
    _hora_reducer: GradientReducer

    def register_local_source(self, source: Any) -> None:
        """Keeps ``source``'s gradient local to this rank (not averaged over the ranks)."""
        self._hora_reducer.register_local_var(source)

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
    del device_dense, device_sparse
    tape = object.__new__(_DistributedGradientTape)
    tape.__dict__.update(gradtape.__dict__)
    tape._hora_reducer = GradientReducer(compression, sparse_as_dense, op,
                                         gradient_predivide_factor, num_groups, groups,
                                         process_set, scale_local_gradients)
    return tape


def PartialDistributedGradientTape(gradtape: tf.GradientTape,  # noqa: N802
                                   device_dense: str = "", device_sparse: str = "",
                                   compression: Any = Compression.none,
                                   sparse_as_dense: bool = False, op: Any = Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Any = None,
                                   process_set: ProcessSet = global_process_set,
                                   local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """A DistributedGradientTape that leaves the gradients of ``local_layers`` (Keras
    layers) on each rank, divided by the set's size when ``scale_local_gradients``."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    if local_layers is not None and not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    for layer in local_layers or ():
        for variable in layer.trainable_weights:
            tape.register_local_source(variable)
    return tape
