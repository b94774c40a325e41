"""``horovod.tensorflow.util`` on hora: Horovod's small TensorFlow helpers."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import tensorflow as tf

__all__: list[str] = []

_has_eager = True


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs eagerly here (False inside a tf.function or a TF1 graph)."""
    return bool(tf.executing_eagerly())


def _make_subgraph(f: Callable[..., Any]) -> Callable[..., Any]:
    return tf.function(f)


def _cache(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` remembered by its arguments, apart for eager and graph callers."""
    cache: dict[Any, Any] = {}

    def wrapper(*args: Any) -> Any:
        key = (args, _executing_eagerly())
        if key not in cache:
            cache[key] = f(*args)
        return cache[key]

    return wrapper


def vars_to_refs(vars: Iterable[Any]) -> Any:  # noqa: A002 - Horovod's name
    """Hashable references of variables (TF2's ``ref()``), as a tuple (a list in, a list out)."""
    if isinstance(vars, list):
        return [v.ref() for v in vars]
    return tuple(v.ref() for v in vars)


def refs_to_vars(refs: Iterable[Any]) -> Any:
    """The variables behind :func:`vars_to_refs`' references."""
    if isinstance(refs, list):
        return [r.deref() for r in refs]
    return tuple(r.deref() for r in refs)
