"""What a DistributedOptimizer's noting hooks noted in a step (:mod:`._gradient_hooks`).

Two kinds that behave the same: a Python list whose bound ``append`` is each
parameter's hook (autograd calls into the interpreter once per gradient), and
notes kept in C++ by hooks on the parameters' gradient accumulators
(:mod:`._native`), which never enter Python during backward. Either way the
sentinel's hook, in Python, notes its parameter first.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any

import torch

__all__ = ["NativeNotes", "PyNotes"]


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
