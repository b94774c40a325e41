"""Putting every rank in the same state: variables and Python objects."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from ..torch import mpi_ops as _engine_ops
from ..torch.functions import allgather_object, broadcast_object
from ._convert import to_numpy, to_torch
from .mpi_ops import ProcessSet, broadcast, global_process_set

__all__ = ["allgather_object", "broadcast_object", "broadcast_object_fn",
           "broadcast_variables"]


def _variable_name(variable: Any, index: int) -> str:
    # Keras 3 names a layer's weights "kernel" and "bias": the path tells them apart,
    # and the index makes every name unique (every rank passes the same list).
    return f"broadcast_variables.{index}.{getattr(variable, 'path', None) or variable.name}"


def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set,
                        inplace: bool = False) -> Any:
    """Overwrites every rank's ``variables`` with the root rank's values.

    In eager mode all variables go out at once (one negotiation, fused on the
    wire); inside a ``tf.function`` each becomes a broadcast op and an assign.
    ``inplace`` is accepted for Horovod's signature.
    """
    del inplace
    variables = list(variables)
    if not tf.executing_eagerly():
        return tf.group(*[v.assign(broadcast(v, root_rank, name=_variable_name(v, i),
                                             process_set=process_set))
                          for i, v in enumerate(variables)])
    handles = [_engine_ops.broadcast_async_(to_torch(v.numpy(), copy=True), root_rank,
                                            name=_variable_name(v, i), process_set=process_set)
               for i, v in enumerate(variables)]
    for variable, handle in zip(variables, handles, strict=True):
        variable.assign(to_numpy(_engine_ops.synchronize(handle)))
    return None


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: ProcessSet = global_process_set) -> Any:
    """Horovod's TF1 helper: a function that broadcasts an object from ``root_rank``."""
    del session

    def fn(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, name=name, process_set=process_set)
    return fn
