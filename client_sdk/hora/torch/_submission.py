"""How a collective's entries reach the engine: names, in-place buffers, the
check that fails an invalid call on every rank, and the handles callers get."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _runtime
from ..engine import Entry, Handle
from ..errors import InvalidTypeError
from ..world import register, synchronize, wait


def _name(name: str | None, op: str, set_id: int) -> str:
    if name is not None and not isinstance(name, str):
        raise InvalidTypeError(f"name must be a string, got {type(name).__name__}")
    return name if name else _runtime.current().auto_name(op, set_id)


def _enqueue(entry: Entry, problem: str | None) -> Handle:
    """Enqueues ``entry``; an invalid one fails on every rank of the call, and here at once.

    Raises:
        InvalidCallError: ``problem`` was given (or another rank's call was invalid).
    """
    # _submit_all for one entry, without its lists: this is every small
    # allreduce's path (a DistributedOptimizer's hook per parameter).
    entry.invalid = problem or ""
    handle = _runtime.current().engine.enqueue(entry)
    if problem:
        wait(handle)  # raises the InvalidCallError every rank of the call gets
    return handle


def _submit(entry: Entry, problem: str | None) -> int:
    """:func:`_enqueue`, with the integer handle Horovod's API returns."""
    return register(_enqueue(entry, problem))


def _submit_all(entries: list[Entry], problems: Sequence[str | None],
                handle_of: Callable[[list[Handle]], Handle]) -> int:
    """Enqueues ``entries`` under one handle; ``problems[i]`` is entry i's own
    problem, so that the error every rank gets names the tensor at fault."""
    engine = _runtime.current().engine
    for entry, problem in zip(entries, problems, strict=True):
        entry.invalid = problem or ""
    engine.enqueue_all(entries)
    handle = register(handle_of([entry.handle for entry in entries]))
    if any(problems):
        synchronize(handle)  # raises the InvalidCallError every rank of the call gets
    return handle


def _copy_back(target: torch.Tensor) -> Any:
    def result(value: torch.Tensor) -> torch.Tensor:
        if value is not target:
            # An inference tensor can only be written inside inference mode.
            with torch.inference_mode(target.is_inference()):
                target.copy_(value.view_as(target))
        return target
    return result


def _own_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor`` that the engine's thread may write.

    It is made outside ``torch.inference_mode()``, so it is a normal tensor even
    when the caller is inside that mode (Lightning's validation and test loops
    are): an inference tensor can only be written inside the mode, and the
    engine's thread is not in it.
    """
    with torch.inference_mode(False):
        return tensor.detach().clone(memory_format=torch.contiguous_format)


def _unwritable(tensor: torch.Tensor) -> str | None:
    """Why an in-place collective cannot write ``tensor``: elements that share
    memory (a dimension of stride 0, as ``expand()`` makes), which torch refuses
    to write. Horovod refuses every non-contiguous tensor; hora writes the others."""
    if tensor.is_contiguous():
        return None
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        if stride == 0 and size > 1:
            return (f"an in-place collective cannot write a {list(tensor.shape)} tensor whose "
                    f"elements share memory (strides {list(tensor.stride())}, as expand() "
                    f"makes): clone() it first, or call the out-of-place form")
    return None


def _in_place(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The buffer a collective writes for ``tensor``, and how the result reaches ``tensor``."""
    if tensor.is_inference():
        return _own_copy(tensor), _copy_back(tensor)
    if tensor.is_contiguous():
        return tensor, None
    return tensor.contiguous(), _copy_back(tensor)


class _Group(Handle):
    """One handle over the tensors of a grouped call; waits for all of them."""

    __slots__ = ("handles",)

    def __init__(self, handles: list[Handle]) -> None:
        super().__init__("group")
        self.handles = handles

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def wait(self, timeout: float | None = None) -> list[Any]:
        """Every tensor's result; a failed one raises, but only once every other
        tensor of the group has completed too, so that none of the group's names
        is still in flight when the caller goes on (and submits them again).
        ``timeout`` holds for the whole group, not for each tensor."""
        deadline = None if timeout is None else time.monotonic() + timeout
        results, error = [], None
        for handle in self.handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                results.append(handle.wait(left))
            except TimeoutError:
                raise
            except Exception as exc:  # noqa: BLE001 - raised below, after the rest
                error = error or exc
        if error is not None:
            raise error
        return results
