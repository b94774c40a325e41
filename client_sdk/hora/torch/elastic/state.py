"""TorchState: a model, an optimizer and plain attributes, committed and restored together."""

from __future__ import annotations

import copy
from typing import Any

import torch

from ... import _runtime
from ...elastic import ObjectState as _ObjectState
from ..functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from ..mpi_ops import Max, allreduce, rank
from .sampler import ElasticSampler

__all__ = ["LRSchedulerStateHandler", "ModelStateHandler", "ObjectState",
           "OptimizerStateHandler", "SamplerStateHandler", "StateHandler", "TorchState",
           "get_handler_registry", "set_handler_registry"]


def _host_update_epoch() -> tuple[int, bool]:
    return _runtime.current().host_update_epoch()


def _generation_host_epoch() -> int:
    return _runtime.current().generation_host_epoch()


def _agree_host_update(mine: tuple[int, bool]) -> tuple[int, bool]:
    """The newest epoch any rank saw, and removals only if every rank says so.

    One small allreduce under a fixed name, so that after the first commit
    it is agreed peer to peer (response cache) without the coordinator; a
    broadcast of a pickled object would cost two negotiated collectives on
    every commit.
    """
    epoch, removals_only = mine
    agreed = allreduce(torch.tensor([epoch, 0 if removals_only else 1], dtype=torch.int64),
                       op=Max, name="hora.elastic.host_update")
    return int(agreed[0]), int(agreed[1]) == 0


class ObjectState(_ObjectState):
    """Plain picklable attributes, synchronised from rank 0: ``ObjectState(epoch=0)``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(bcast_object=broadcast_object, get_rank=rank,
                         host_update_epoch=_host_update_epoch,
                         agree_host_update=_agree_host_update,
                         generation_host_epoch=_generation_host_epoch, **kwargs)


class StateHandler:
    """Saves, restores and synchronises one kind of object held by a :class:`TorchState`.

    Subclass it for a type of your own and add ``(type, subclass)`` to the registry
    (:func:`set_handler_registry`), as with Horovod.
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def set_value(self, value: Any) -> None:
        """Holds a new object, saved as it is now."""
        self.value = value
        self.save()


class _StateDictHandler(StateHandler):
    """An object with ``state_dict()`` and ``load_state_dict()``, saved as a deep copy."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)


class ModelStateHandler(_StateDictHandler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class LRSchedulerStateHandler(_StateDictHandler):
    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0))


class SamplerStateHandler(_StateDictHandler):
    def sync(self) -> None:
        # What any rank processed this epoch counts as processed for all of them.
        from ..functions import allgather_object

        gathered = allgather_object(set(self.value.processed_indices))
        state = self.value.state_dict()
        state["processed_indices"] = set().union(*gathered)
        self.value.load_state_dict(broadcast_object(state, root_rank=0))


_handler_registry: list[tuple[type, type[StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (torch.optim.lr_scheduler.LRScheduler, LRSchedulerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, type[StateHandler]]]:
    """The ``(type, handler class)`` pairs TorchState picks handlers from, first match wins."""
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, type[StateHandler]]]) -> None:
    """Replaces the registry (add your own pairs to :func:`get_handler_registry`'s list)."""
    global _handler_registry
    _handler_registry = registry


def _handler_for(value: Any) -> StateHandler | None:
    for kind, handler in _handler_registry:
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """The state of a PyTorch training loop.

    Args:
        model: the model; its ``state_dict`` is saved on commit and broadcast on sync.
        optimizer: the optimizer; likewise (``broadcast_optimizer_state``).
        **kwargs: more attributes: modules, optimizers, LR schedulers and
            ElasticSamplers get their handlers (see :func:`get_handler_registry`);
            anything else must be picklable (``epoch=0, batch=0``).
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, StateHandler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = _handler_for(value) if value is not None else None
            if handler is not None:
                handlers[name] = handler
            else:
                plain[name] = value
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(**plain)

    _handlers: dict[str, Any]

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            # A new model or optimizer is saved at once, as Horovod's handlers do: a
            # restore() must not load the old one's state into it.
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
            # A restore() goes back to the synchronised values, not to this rank's own
            # from before the sync (a new rank 0 would restore and broadcast those).
            handler.save()
        super().sync()
