"""CUDA tensors through host memory, for ranks that share one GPU.

NCCL refuses a communicator in which two ranks use the same GPU ("Duplicate
GPU detected"), so ``horarun -np 2`` on a one-GPU workstation could not run
a CUDA collective at all. When the ranks of a group find that they share a
device (:func:`shared_devices`), the group's CUDA backend is a
:class:`HostStagedBackend` instead: it copies each tensor to the host, runs
the collective through a CPU backend (Gloo), and copies the result back.
The results are the same bits NCCL would give for data-moving collectives,
and the CPU backend's reductions for the others; the cost is two copies per
collective, which is why the choice is announced once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .base import Backend, ReduceKind

__all__ = ["HostStagedBackend", "device_identity", "shared_devices"]


def device_identity() -> str:
    """This process's current CUDA device, as an id no other GPU has (its UUID)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else f"pci:{props.pci_bus_id}"  # type: ignore[attr-defined]


def shared_devices(store: dist.Store, rank: int, size: int,
                   identity: str | None = None) -> dict[str, list[int]]:
    """The devices that more than one rank of the group uses, with those ranks.

    Every rank of the group calls this together: each publishes its device
    (``identity``, by default :func:`device_identity`) and reads the others'
    (the store's timeout bounds the wait).
    """
    store.set(f"device/{rank}", identity if identity is not None else device_identity())
    ranks_of: dict[str, list[int]] = {}
    for peer in range(size):
        ranks_of.setdefault(store.get(f"device/{peer}").decode(), []).append(peer)
    return {device: ranks for device, ranks in ranks_of.items() if len(ranks) > 1}


class HostStagedBackend:
    """A CUDA backend that runs each collective on host copies through ``inner``."""

    name = "staged"
    reads_input = True

    def __init__(self, inner: Backend) -> None:
        self._inner = inner

    def allreduce(self, tensor: torch.Tensor, op: ReduceKind) -> None:
        host = tensor.cpu()
        self._inner.allreduce(host, op)
        tensor.copy_(host)

    def allgatherv(self, output: torch.Tensor, tensor: torch.Tensor,
                   counts: Sequence[int]) -> None:
        host = torch.empty(output.shape, dtype=output.dtype)
        self._inner.allgatherv(host, tensor.cpu(), counts)
        output.copy_(host)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        host = tensor.cpu()
        self._inner.broadcast(host, root)
        tensor.copy_(host)

    def alltoallv(self, output: torch.Tensor, tensor: torch.Tensor,
                  output_splits: Sequence[int], input_splits: Sequence[int]) -> None:
        host = torch.empty(output.shape, dtype=output.dtype)
        self._inner.alltoallv(host, tensor.cpu(), output_splits, input_splits)
        output.copy_(host)

    def reducescatter(self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceKind,
                      counts: Sequence[int]) -> None:
        host = torch.empty(output.shape, dtype=output.dtype)
        self._inner.reducescatter(host, tensor.cpu(), op, counts)
        output.copy_(host)

    def barrier(self) -> None:
        self._inner.barrier()

    def close(self) -> None:
        self._inner.close()
