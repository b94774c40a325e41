"""A DistributedOptimizer's gradient hooks (see :mod:`.optimizer`), of two kinds.

- **Handing over** (:func:`_single_hook`, or ``_on_grad`` for a parameter in
  a group of several): each hook counts its parameter's backward passes and
  hands the gradient to the engine, every ``HANDOVER_BYTES`` while backward
  runs. A gradient computed again before ``step()`` raises in its own hook.
- **Noting**, for the steps whose gradients go as one allreduce at
  ``synchronize()`` (:mod:`._fused`): nothing of a step starts before
  ``synchronize()``, so each hook only notes that its gradient came. Every
  parameter's hook but one is the bound ``append`` of a list, which Python
  runs without a frame: on section 2c of bench/README.md (400 gradients),
  0.28-0.64 ms a step less than the handing-over hooks, in the same launch.
  The one left (the *sentinel*) is the parameter whose gradient came first
  in the last step, so that its hook runs first in the next backward pass:
  it begins the step in the current world (raising outside one, as the first
  handing-over hook does) and raises when its gradient was computed before
  in this step, as a handing-over hook does. ``synchronize()`` checks the
  noted list for any other gradient computed twice (a second backward pass
  the sentinel is not part of), and raises the same error there; it hands the
  noted gradients over when the step does not go as one allreduce after all
  (a new world's first step).

Noting is used only where it changes nothing a script sees: each parameter
alone in its group, one backward pass per step, gradients that qualify for one
allreduce, after a step of the world that went gradient by gradient (which
finds the sentinel), and while every step begins with the sentinel's gradient.
What differs, in a backward pass that does not reach the sentinel only: a
gradient computed twice raises at ``synchronize()`` instead of in backward,
and outside a world the pass raises nothing (the next ``synchronize()`` or
``step()`` does). The optimizer re-arms its hooks after each step that
succeeded.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .. import _runtime
from ..errors import GradientComputedAgainError
from ._native import hooks_module
from ._notes import NativeNotes, PyNotes
from ._optimizer_step import _HANDED_OVER, HANDOVER_BYTES, _Slot

__all__ = ["_GradientHooks", "_computed_again"]


def _computed_again(name: str, passes: int) -> str:
    """The error of a gradient computed more often than a step takes."""
    return (f"the gradient of {name!r} was computed again before step(): call "
            f"optimizer.step() or optimizer.synchronize() after every {passes} backward "
            f"pass(es), or raise backward_passes_per_step")


def _single_hook(opt: Any, slot: _Slot) -> Callable[[torch.Tensor], None]:
    """The handing-over hook of a parameter alone in its group (each parameter
    is, unless the script groups them): the common case inline (the step's
    world is current, this is the last of its backward passes, nothing is
    pending), anything else through ``opt._on_grad``, which begins the step,
    counts the passes or raises. Against a ``functools.partial`` of
    ``_on_grad`` it took 0.2-0.5 ms off the backward pass of section 2c's 400
    gradients, in one launch (bench/README.md, "Twelfth pass")."""
    on_grad, handed, nbytes = opt._on_grad, opt._handed, slot.nbytes

    def hook(p: torch.Tensor) -> None:
        current = opt._step_runtime
        if (slot.pending is not None or slot.delay != 1 or current is None
                or current is not _runtime._runtime):
            on_grad(slot, p)
            return
        slot.delay = 0
        slot.pending = _HANDED_OVER
        handed.append(slot)
        opt._handed_bytes += nbytes
        if opt._handed_bytes >= HANDOVER_BYTES:
            opt._submit_handed()

    return hook


class _GradientHooks:
    """The hooks on an optimizer's parameters, and what the noting ones noted.

    Attributes:
        noted: the parameters whose gradients came this step, in order (noting
            hooks only; empty otherwise).
    """

    def __init__(self, opt: Any) -> None:
        self._opt = opt
        self._handles: list[Any] = []
        self.noted: PyNotes | NativeNotes = PyNotes()
        self._sentinel: torch.Tensor | None = None  # None: handing over
        # Whether a step's first gradient was not the sentinel's: handing over for good.
        self._varies = False
        self._world = _runtime._runtime  # the world of the notes (see ``world``)

    @property
    def noting(self) -> bool:
        return self._sentinel is not None

    def arm(self, sentinel: torch.Tensor | None) -> None:
        """Noting hooks with ``sentinel`` first, or (None) handing-over hooks;
        nothing changes when they are armed so already.
        The noting hooks are C++ where :mod:`._native` is built (the notes
        then live there too), else each is the bound ``append`` of a list."""
        if self._handles and sentinel is self._sentinel:
            return
        for handle in self._handles:
            handle.remove()
        self._handles, self._sentinel = [], sentinel
        opt = self._opt
        params = list(opt._slot)
        module = hooks_module() if sentinel is not None else None
        notes = NativeNotes(module, params) if module is not None else PyNotes()
        notes.extend(self.noted)  # (notes of a step in progress carry over)
        self.noted = notes
        if sentinel is None:
            for p, slot in opt._slot.items():
                hook = (_single_hook(opt, slot) if opt._group_sizes[slot.group] == 1
                        else functools.partial(opt._on_grad, slot))
                self._handles.append(p.register_post_accumulate_grad_hook(hook))
            return
        first = next(i for i, p in enumerate(params) if p is sentinel)
        self._handles.append(sentinel.register_post_accumulate_grad_hook(self._sentinel_hook()))
        self._handles += notes.hook(params, first)

    def after_step(self, first: torch.Tensor | None) -> None:
        """After a step that succeeded, whose first gradient was ``first``
        (None: no gradient came): noting hooks while the steps go as one
        allreduce and each begins with the same gradient, else handing over.
        A model whose first gradient varies (heads trained by turns) hands
        over for good: re-arming 400 hooks took 2.5 ms, more than noting saves.
        (No hooks stay none: a process set of one rank.)"""
        if not self._handles:
            return
        opt, fused = self._opt, self._opt._fused
        eligible = (fused is not None and fused.flat is not None
                    and fused.validated is not None and not opt._sparse
                    and opt.backward_passes_per_step == 1 and max(opt._group_sizes) == 1)
        if self.noting and first is not None and first is not self._sentinel:
            self._varies = True
        if not eligible or self._varies:
            self.arm(None)
        elif not self.noting and first is not None:
            self.arm(first)

    def remove(self) -> None:
        """Takes every hook off its parameter for good (a Lightning fit's end:
        a later fit wraps the optimizer again)."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._sentinel = [], None

    def _sentinel_hook(self) -> Callable[[torch.Tensor], None]:
        # Weakly: the C++ notes hold the gradient accumulators, which hold the
        # parameters, which hold this hook; a strong reference back to the notes
        # would be a cycle through C++ that Python's collector cannot free.
        ref = weakref.ref(self._opt)

        def hook(p: torch.Tensor) -> None:
            opt = ref()
            if opt is None:
                return  # (the optimizer is gone; the model lives on)
            noted = opt._hooks.noted
            if opt._step_runtime is None or opt._step_runtime is not _runtime._runtime:
                opt._begin_step()  # raises NotInitializedError outside a world
            if noted and noted.has(p):
                # The pass stops here; what came before the sentinel counts once.
                noted.dedupe()
                raise GradientComputedAgainError(
                    _computed_again(opt._names[p], opt.backward_passes_per_step))
            noted.append(p)

        return hook

    def first(self) -> torch.Tensor | None:
        """The parameter whose gradient came first this step (None: none came)."""
        if self.noted:
            return self.noted[0]
        handed = self._opt._handed
        return handed[0].param if handed else None

    def reset(self) -> None:
        """Forgets the step's notes (the hooks hold the list: emptied in place)."""
        self.noted.clear()
        self._world = _runtime._runtime

    def world(self) -> Any:
        """The world of the notes of a backward pass that the sentinel, which
        begins a step, did not reach (None: no notes): the world of the last
        step. When that world has ended, the notes go with it as a begun step
        does (they may be the new world's: its first step checks every
        gradient, and submits them all anyway)."""
        return self._world if self.noted else None

    def check(self) -> None:
        """Raises the error of a gradient noted twice this step (a second
        backward pass that did not reach the sentinel), after forgetting the
        step: nothing of a noting step is in flight yet."""
        noted = self.noted
        noted.refresh()  # (C++ hooks: a parameter given new data is hooked again)
        p = noted.noted_twice()
        if p is not None:
            opt = self._opt
            opt._reset_step()
            raise GradientComputedAgainError(
                _computed_again(opt._names[p], opt.backward_passes_per_step))

    def hand_over(self) -> None:
        """Hands the noted gradients to the optimizer as handing-over hooks
        would have (``opt._handed``), in the order they came."""
        opt = self._opt
        for p in self.noted:  # (a step that is not fused: rare enough to key by tensor)
            slot = opt._slot[p]
            slot.delay = 0
            slot.pending = _HANDED_OVER
            opt._handed.append(slot)
            opt._handed_bytes += slot.nbytes
        self.noted.clear()
