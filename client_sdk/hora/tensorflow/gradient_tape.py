"""``hvd.DistributedGradientTape``: a GradientTape whose gradients are averaged over ranks."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ._gradients import GradientReducer
from .compression import Compression
from .mpi_ops import Average, ProcessSet, global_process_set

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]


def _ref(source: Any) -> Any:
    return source.ref() if hasattr(source, "ref") else id(source)


class _DistributedGradientTape(tf.GradientTape):
    _hora_reducer: GradientReducer
    _hora_local: set[Any]
    _hora_scale_local: bool

    def register_local_source(self, source: Any) -> None:
        """Keeps ``source``'s gradient local to this rank (not averaged over the ranks)."""
        self._hora_local.add(_ref(source))

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 **kwargs: Any) -> Any:
        grads = super().gradient(target, sources, output_gradients, **kwargs)
        flat = tf.nest.flatten(grads, expand_composites=False)
        flat_sources = tf.nest.flatten(sources)
        local = [_ref(s) in self._hora_local for s in flat_sources]
        reduced = self._hora_reducer.reduce([None if mine else g for g, mine in
                                             zip(flat, local, strict=True)], flat_sources)
        # Local gradients are divided by the set's size when asked (Horovod's default), as
        # an averaged gradient of the same layer would be.
        world = self._hora_reducer.process_set.size()
        for i, mine in enumerate(local):
            if mine:
                reduced[i] = _scaled(flat[i], 1.0 / world) if self._hora_scale_local \
                    else flat[i]
        return tf.nest.pack_sequence_as(grads, reduced)


def _scaled(grad: Any, factor: float) -> Any:
    if grad is None or factor == 1.0:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * factor, grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


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
                                         process_set)
    tape._hora_local = set()
    tape._hora_scale_local = scale_local_gradients
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
