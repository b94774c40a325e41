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
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

__all__ = ["Backend", "BackendError", "ReduceKind"]


class BackendError(RuntimeError):
    """A data-plane collective failed on this rank."""


class ReduceKind(enum.Enum):
    """Reductions the native libraries perform themselves.

    Averaging and pre/post scaling are done by the engine around a SUM, so
    that every backend behaves the same way.
    """

    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


@runtime_checkable
class Backend(Protocol):
    """Collectives over one process group. Tensors are contiguous."""

    name: str

    def allreduce(self, tensor: torch.Tensor, op: ReduceKind) -> None:
        """Reduces ``tensor`` across ranks in place."""

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
