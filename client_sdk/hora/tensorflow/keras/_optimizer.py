"""Keras optimizers whose gradients are averaged over the ranks (Keras 3 and tf-keras)."""

from __future__ import annotations

from typing import Any

from .._gradients import GradientReducer

__all__ = ["distributed_class", "is_distributed"]

_CLASSES: dict[type, type] = {}


def is_distributed(optimizer: Any) -> bool:
    return getattr(optimizer, "_hora_reducer", None) is not None


def distributed_class(cls: type) -> type:
    """A subclass of the optimizer class ``cls`` that reduces gradients before applying them.

    It carries the original's name and module, so that a saved model names
    the plain optimizer and loads without hora (``hvd.load_model`` wraps it again).
    """
    found = _CLASSES.get(cls)
    if found is not None:
        return found
    # Keras 3 funnels apply_gradients into apply(grads, variables); tf-keras's
    # optimizers (new and legacy) have apply_gradients only.
    keras3 = hasattr(cls, "stateless_apply")

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        variables = trainable_variables if trainable_variables is not None else \
            getattr(self, "_trainable_variables", None)
        grads = self._hora_reducer.reduce(list(grads), variables)
        return super(sub, self).apply(grads, trainable_variables)

    def apply_gradients(self: Any, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        pairs = list(grads_and_vars)
        grads = self._hora_reducer.reduce([g for g, _ in pairs], [v for _, v in pairs])
        return super(sub, self).apply_gradients(
            list(zip(grads, [v for _, v in pairs], strict=True)), *args, **kwargs)

    sub: Any
    body: dict[str, Any] = {"_hora_reducer": None, "__module__": cls.__module__,
                            "__qualname__": cls.__qualname__}
    body["apply" if keras3 else "apply_gradients"] = apply if keras3 else apply_gradients
    sub = type(cls.__name__, (cls,), body)
    _CLASSES[cls] = sub
    return sub


def make_distributed(optimizer: Any, reducer: GradientReducer, in_place: bool) -> Any:
    """``optimizer`` made distributed: a new one from its config, or (``in_place``) the same
    object, state and all (for a loaded model)."""
    if is_distributed(optimizer):
        raise ValueError("the optimizer is already a hvd.DistributedOptimizer")
    cls: Any = distributed_class(type(optimizer))
    if in_place:
        optimizer.__class__ = cls
        target = optimizer
    else:
        target = cls.from_config(optimizer.get_config())
    object.__setattr__(target, "_hora_reducer", reducer)
    return target
