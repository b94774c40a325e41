"""The interface every data-plane backend implements.

A backend moves tensor bytes between the ranks of one generation, peer to
peer. It knows nothing about names, negotiation or fusion: the engine
above it decides what runs and in which order, and every rank calls the
same backend methods in the same order. All methods block until the
collective has finished on this rank, or raise ``BackendError`` (a peer
died, the timeout passed).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

__all__ = ["Backend", "BackendError", "PlacedViews", "ReduceKind", "Reducer", "RegionViews",
           "scale_"]


class BackendError(RuntimeError):
    """A data-plane collective failed on this rank."""


class ReduceKind(enum.Enum):
    """Reductions the native libraries perform themselves.

    Averaging and pre/post scaling are done around a SUM (see
    :func:`scale_`), so that every backend behaves the same way.
    """

    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


class Reducer(Protocol):
    """What the engine's allreduce needs of a backend: every :class:`Backend`,
    and the mesh's reducers that implement allreduce alone
    (:class:`~.mesh.CarriedBatch`, :class:`~.mesh.PairwiseAllreduce`)."""

    @property
    def name(self) -> str: ...

    #: False for a backend whose allreduce finds every rank's contribution,
    #: already prescaled, elsewhere (the mesh's payloads): the engine then
    #: neither copies its input into the buffer nor prescales it.
    @property
    def reads_input(self) -> bool: ...

    def allreduce(self, tensor: torch.Tensor, op: ReduceKind) -> None:
        """Reduces ``tensor`` across ranks in place."""


@runtime_checkable
class Backend(Reducer, Protocol):
    """Collectives over one process group. Tensors are contiguous."""

    def allgatherv(self, output: torch.Tensor, tensor: torch.Tensor,
                   counts: Sequence[int]) -> None:
        """Concatenates every rank's ``tensor`` along dim 0 into ``output``.

        ``counts[r]`` is the first-dimension size of rank r's tensor.
        """

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """Overwrites ``tensor`` on every rank with the root's, in place."""

    def alltoallv(self, output: torch.Tensor, tensor: torch.Tensor,
                  output_splits: Sequence[int], input_splits: Sequence[int]) -> None:
        """Sends ``input_splits[r]`` rows to rank r and receives ``output_splits[r]`` from it."""

    def reducescatter(self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceKind,
                      counts: Sequence[int]) -> None:
        """Reduces ``tensor`` and leaves rows ``[sum(counts[:r]), +counts[r])`` in ``output``."""

    def barrier(self) -> None:
        """Returns once every rank has called it."""

    def close(self) -> None:
        """Releases the process group; later calls fail."""


def scale_(tensor: torch.Tensor, factor: float) -> None:
    """Multiplies ``tensor`` by ``factor`` in place: the one definition of scaling.

    The engine multiplies each rank's contribution by the prescale factor
    before a reduction and the result by the postscale factor (over the
    set's size, for an average) after it; the mesh prescales a contribution
    while packing it. Integers are scaled in double precision and truncated
    toward zero, as Horovod does for integer averages.
    """
    if factor == 1.0:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.mul_(factor)
    else:
        tensor.copy_(tensor.to(torch.float64).mul_(factor).trunc_())


class PlacedViews:
    """Views of a flat buffer laid out as a list of tensors, kept across rounds.

    A fused batch copies its tensors into one flat buffer and back. Making a
    view per tensor costs a torch call each (a few µs), for the same layout
    round after round in training; this keeps the last few layouts' views,
    so that a whole batch moves with one ``torch._foreach_copy_``.

    A layout is keyed by the buffer's address and dtype and a key the caller
    chooses, with which equal keys mean equal layouts: the placements
    themselves, or an object that stands for them (kept here, so that it
    stays alive while it is a key). The views hold the buffer's storage, so
    that address cannot be handed to another buffer while they are kept.

    Args:
        keep: how many layouts to keep (the oldest goes first).
    """

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._views: dict[tuple[object, ...], list[torch.Tensor]] = {}

    def get(self, buffer: torch.Tensor, key: object, place: Callable[[], Placement]
            ) -> list[torch.Tensor]:
        """Views of ``buffer`` (uint8 or of any dtype, contiguous), one per tensor
        of the layout ``key`` stands for. On a miss ``place()`` gives the
        layout: each tensor's (byte offset, dtype, shape), and tensors of those
        dtypes and shapes."""
        full = (buffer.data_ptr(), buffer.dtype, key)
        views = self._views.get(full)
        if views is None:
            placed, like = place()
            views = _views_of(buffer, placed, like)
            with self._lock:  # several threads may share one (a set's, the rounds')
                while len(self._views) >= self._keep:
                    del self._views[next(iter(self._views))]
                self._views[full] = views
        return views

    def clear(self) -> None:
        with self._lock:
            self._views.clear()


class RegionViews:
    """Typed views of byte regions of buffers, kept across rounds.

    Slicing a tensor and viewing it as another dtype costs several µs each,
    and a round of the mesh asks for the same few regions every time (where
    each rank's payload holds a batch). A view is keyed by the address of the
    region, its length and dtype: it holds its buffer's storage, so that
    address cannot be handed to other memory while the view is kept, and
    views of the same address and length are views of the same bytes.

    Views hold their buffer's memory: a holder drops them (:meth:`clear`) when
    it replaces a buffer, so that the old one can go.

    Args:
        keep: how many views to keep (all are dropped when it is reached).
    """

    def __init__(self, keep: int = 16) -> None:
        self._keep = keep
        self._views: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def get(self, buffer: torch.Tensor, start: int, nbytes: int, dtype: torch.dtype
            ) -> torch.Tensor:
        """``buffer[start:start + nbytes]`` (uint8, contiguous) viewed as ``dtype``."""
        key = (buffer.data_ptr() + start, nbytes, dtype)
        found = self._views.get(key)
        if found is None:
            if len(self._views) >= self._keep:
                self._views.clear()
            found = self._views[key] = buffer[start:start + nbytes].view(dtype)
        return found

    def clear(self) -> None:
        self._views.clear()


#: A layout of tensors in a flat buffer: each one's (byte offset, dtype, shape),
#: and tensors of those dtypes and shapes.
Placement = tuple[Sequence[tuple[int, torch.dtype, torch.Size]], Sequence[torch.Tensor]]


def _views_of(buffer: torch.Tensor, placed: Sequence[tuple[int, torch.dtype, torch.Size]],
              like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """:meth:`PlacedViews.get` without the keeping: each run of tensors of one
    dtype that lie back to back is viewed by one torch call."""
    raw = buffer.view(torch.uint8) if buffer.dtype != torch.uint8 else buffer
    views: list[torch.Tensor] = []
    i, n = 0, len(placed)
    while i < n:
        start, dtype, _shape = placed[i]
        itemsize = dtype.itemsize
        end, j = start, i
        while j < n and placed[j][1] == dtype and placed[j][0] == end:
            end += placed[j][2].numel() * itemsize
            j += 1
        run = raw[start:end].view(dtype)
        made = torch._C._nn.unflatten_dense_tensors(run, list(like[i:j]))
        # An empty tensor comes back 1-D and apart from the buffer: shape it.
        views.extend(view if view.numel() else run[:0].view(shape)
                     for view, (_start, _dtype, shape) in zip(made, placed[i:j], strict=True))
        i = j
    return views
