"""Elastic training with TensorFlow: ``hvd.elastic.run``, ``TensorFlowKerasState``, ...

The retry loop is hora's one (:mod:`hora.elastic`, reset by :mod:`hora.torch.elastic`);
what is TensorFlow's here is how a model's and an optimizer's variables are
saved, restored and broadcast, and how an engine error raised inside a
``tf.function`` (which TensorFlow re-raises as an ``OpError``) is recognised.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from ..elastic import State
from ..errors import HorovodInternalError, HostsUpdatedInterrupt
from ..torch import elastic as _torch_elastic
from ..torch.elastic import ObjectState
from .functions import broadcast_variables
from .mpi_ops import engine_error

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TensorFlowKerasState", "TensorFlowState", "run"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorates ``func(state, ...)`` to survive workers lost or added (see hora.torch.elastic)."""

    @functools.wraps(func)
    def unwrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            original = engine_error(exc)
            if original is None or original is exc:
                raise
            raise original from exc

    return _torch_elastic.run(unwrapped)


def _optimizer_variables(optimizer: Any) -> list[Any]:
    if optimizer is None:
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class TensorFlowState(ObjectState):
    """Variables (``tf.Variable``) and plain attributes, committed and restored together."""

    _hora_variables: list[Any]
    _hora_saved: list[tuple[Any, Any]] | None

    def __init__(self, variables: Sequence[Any] | None = None, session: Any = None,
                 **kwargs: Any) -> None:
        del session  # TF1's; TF2 variables are read and assigned eagerly
        object.__setattr__(self, "_hora_variables", list(variables or []))
        object.__setattr__(self, "_hora_saved", None)
        super().__init__(**kwargs)
        self.save()

    def _variables(self) -> list[Any]:
        return list(self._hora_variables)

    def save(self) -> None:
        object.__setattr__(self, "_hora_saved", [(v, v.numpy()) for v in self._variables()])
        super().save()

    def restore(self) -> None:
        # Variables made after the commit (an optimizer's first slots) keep their values.
        for variable, value in self._hora_saved or ():
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        variables = self._variables()
        if variables:
            broadcast_variables(variables, root_rank=0)
        # What every rank now holds is what a restore() goes back to, as in Horovod:
        # not the rank's own values from before the sync.
        object.__setattr__(self, "_hora_saved", [(v, v.numpy()) for v in variables])
        super().sync()


class TensorFlowKerasState(TensorFlowState):
    """A Keras model, its optimizer and plain attributes: ``KerasState(model, epoch=0)``."""

    model: Any
    optimizer: Any

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        del backend
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer if optimizer is not None
                           else getattr(model, "optimizer", None))
        super().__init__(None, **kwargs)

    def _variables(self) -> list[Any]:
        return list(self.model.variables) + _optimizer_variables(self.optimizer)
