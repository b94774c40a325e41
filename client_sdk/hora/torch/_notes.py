"""What a DistributedOptimizer's noting hooks noted in a step (:mod:`._gradient_hooks`),
and the checks of its fused buffer's views (:mod:`._fused`): in Python here, in C++
in ``hora_torch_hooks.cpp`` (:mod:`._native`), behaving the same.

Notes come in two kinds: a Python list whose bound ``append`` is each
parameter's hook (autograd calls into the interpreter once per gradient), and
notes kept in C++ by hooks on the parameters' gradient accumulators
(:mod:`._native`), which never enter Python during backward. Either way the
sentinel's hook, in Python, notes its parameter first.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence
from types import ModuleType
from typing import Any

import torch

__all__ = ["NativeNotes", "PyFusedViews", "PyNotes"]

_GRAD = operator.attrgetter("grad")
_SHAPE = operator.attrgetter("shape")
_DATA_PTR = torch.Tensor.data_ptr


class PyNotes(list):
    """The parameters noted, in order; each hook is this list's ``append``."""

    def has(self, p: torch.Tensor) -> bool:
        return any(q is p for q in self)

    def dedupe(self) -> None:
        """Keeps each parameter's first note."""
        self[:] = {id(q): q for q in self}.values()

    def noted_twice(self) -> torch.Tensor | None:
        """The first parameter noted twice (None: none was)."""
        if len(set(map(id, self))) == len(self):
            return None
        seen: set[int] = set()
        for p in self:
            if id(p) in seen:
                return p
            seen.add(id(p))
        return None

    def hook(self, params: list[torch.Tensor], skip: int) -> list[Any]:
        """Notes each of ``params`` but the one at ``skip``: their hooks' handles."""
        return [p.register_post_accumulate_grad_hook(self.append)
                for i, p in enumerate(params) if i != skip]

    def refresh(self) -> None:
        """(A tensor's hooks stay when its gradient accumulator is rebuilt.)"""


class NativeNotes:
    """The same notes, kept in C++ by hooks on the gradient accumulators."""

    def __init__(self, module: ModuleType, params: list[torch.Tensor]) -> None:
        self._module = module
        self._params = params
        self._index = {id(p): i for i, p in enumerate(params)}
        self._notes = module.Notes(len(params))
        self._hooks: Any = None

    def append(self, p: torch.Tensor) -> None:
        self._notes.note(self._index[id(p)])

    def extend(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            self.append(p)

    def __len__(self) -> int:
        return int(self._notes.count())

    def __iter__(self) -> Iterator[torch.Tensor]:
        params = self._params
        return iter([params[i] for i in self._notes.order()])

    def __getitem__(self, k: int) -> torch.Tensor:
        return self._params[self._notes.at(k)]

    def clear(self) -> None:
        self._notes.clear()

    def has(self, p: torch.Tensor) -> bool:
        return bool(self._notes.contains(self._index[id(p)]))

    def dedupe(self) -> None:
        self._notes.dedupe()

    def noted_twice(self) -> torch.Tensor | None:
        index = self._notes.repeated()
        return self._params[index] if index >= 0 else None

    def hook(self, params: list[torch.Tensor], skip: int) -> list[Any]:
        """Notes each of ``params`` (this object's, in order) but the one at
        ``skip``: one handle that removes every hook."""
        self._hooks = self._module.NotingHooks(
            self._notes, params, [i for i in range(len(params)) if i != skip])
        return [self._hooks]

    def refresh(self) -> None:
        """Hooks again the parameters given data of another shape, dtype or
        device since they were hooked (see ``NotingHooks::refresh``)."""
        if self._hooks is not None:
            self._hooks.refresh()


class PyFusedViews:
    """``FusedViews`` of ``hora_torch_hooks.cpp``, in Python: whether the
    parameters' gradients are still their views of the fused buffer, and their
    data and shapes as they were (one pass over the parameters each)."""

    def __init__(self, params: list[torch.Tensor], views: list[torch.Tensor],
                 shapes: list[torch.Size], view_data: list[int]) -> None:
        self._params, self._views = params, views
        self._shapes, self._view_data = shapes, view_data
        self._data: list[int] | None = None  # (none noted yet)

    def views_except(self, loose: Sequence[int]) -> bool:
        """Whether every gradient but those at ``loose`` is its view."""
        views = self._views
        if not loose:
            return all(map(operator.is_, map(_GRAD, self._params), views))
        grads = list(map(_GRAD, self._params))
        for i in loose:
            grads[i] = views[i]
        return all(map(operator.is_, grads, views))

    def note_data(self) -> None:
        self._data = list(map(_DATA_PTR, self._params))

    def same_data(self) -> bool:
        return list(map(_DATA_PTR, self._params)) == self._data

    def same_shapes(self) -> bool:
        return list(map(_SHAPE, self._params)) == self._shapes

    def views_in_place(self) -> bool:
        return list(map(_DATA_PTR, self._views)) == self._view_data
