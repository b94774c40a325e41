"""Keras optimizers whose gradients are averaged over the ranks (Keras 3 and tf-keras)."""

from __future__ import annotations

from typing import Any

from .._aggregation import LocalAggregator
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
    # Keras 3 runs every update, accumulated over gradient_accumulation_steps or not,
    # through _backend_apply_gradients and then _clip_gradients (only on the step that
    # applies): the gradients are reduced there, once per update. tf-keras's optimizers
    # (new and legacy) have apply_gradients.
    keras3 = hasattr(cls, "stateless_apply") and hasattr(cls, "_clip_gradients")

    def _backend_apply_gradients(self: Any, grads: Any, trainable_variables: Any) -> Any:
        object.__setattr__(self, "_hora_variables", list(trainable_variables))
        return super(sub, self)._backend_apply_gradients(grads, trainable_variables)

    def _clip_gradients(self: Any, grads: Any) -> Any:
        variables = getattr(self, "_hora_variables", None)
        if variables is not None and len(variables) != len(grads):
            variables = None
        grads = self._hora_reducer.reduce(list(grads), variables)
        return super(sub, self)._clip_gradients(grads)

    def apply_gradients(self: Any, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        pairs = list(grads_and_vars)
        variables = [v for _, v in pairs]
        aggregator = self._hora_aggregator
        if aggregator is None:
            grads = self._hora_reducer.reduce([g for g, _ in pairs], variables)
            return super(sub, self).apply_gradients(
                list(zip(grads, variables, strict=True)), *args, **kwargs)
        grads = aggregator.compute([g for g, _ in pairs], variables)
        iterations = self.iterations  # made here, not inside a branch

        def apply() -> Any:
            return super(sub, self).apply_gradients(
                list(zip(grads, variables, strict=True)), *args, **kwargs)

        return aggregator.apply(apply, lambda: iterations.assign_add(1))

    def register_local_var(self: Any, var: Any) -> None:
        """Keeps ``var``'s gradient on this rank (see PartialDistributedOptimizer)."""
        self._hora_reducer.register_local_var(var)

    sub: Any
    body: dict[str, Any] = {"_hora_reducer": None, "_hora_aggregator": None,
                            "register_local_var": register_local_var,
                            "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    if keras3:
        body.update(_backend_apply_gradients=_backend_apply_gradients,
                    _clip_gradients=_clip_gradients)
    else:
        body.update(apply_gradients=apply_gradients)
    sub = type(cls.__name__, (cls,), body)
    _CLASSES[cls] = sub
    return sub


def make_distributed(optimizer: Any, reducer: GradientReducer, in_place: bool,
                     backward_passes_per_step: int = 1,
                     average_aggregated_gradients: bool = False) -> Any:
    """``optimizer`` made distributed: a new one from its config, or (``in_place``) the same
    object, state and all (for a loaded model).

    ``backward_passes_per_step > 1`` becomes a Keras 3 optimizer's own
    ``gradient_accumulation_steps`` (the accumulated gradients are reduced once per
    update); tf-keras's optimizers, which have none, get a :class:`LocalAggregator`.
    Either way the passes are summed, or averaged with ``average_aggregated_gradients``.
    """
    if is_distributed(optimizer):
        raise ValueError("the optimizer is already a hvd.DistributedOptimizer")
    cls: Any = distributed_class(type(optimizer))
    aggregator = None
    if in_place:
        optimizer.__class__ = cls
        target = optimizer
    else:
        config = optimizer.get_config()
        if backward_passes_per_step > 1:
            if "gradient_accumulation_steps" in config:
                config["gradient_accumulation_steps"] = backward_passes_per_step
                if not average_aggregated_gradients:
                    # Keras averages what it accumulated; Horovod's default sums it.
                    reducer.post *= backward_passes_per_step
                    reducer.local_post *= backward_passes_per_step
            else:
                aggregator = LocalAggregator(reducer, backward_passes_per_step,
                                             average_aggregated_gradients)
        target = cls.from_config(config)
    object.__setattr__(target, "_hora_reducer", reducer)
    object.__setattr__(target, "_hora_aggregator", aggregator)
    return target
