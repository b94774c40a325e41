"""Gloo: the CPU data plane, through torch.distributed's ProcessGroupGloo.

Gloo's listening socket is closed as soon as the group is built (every
pair is connected by then): see :mod:`.gloo_listener`.

The process group is built directly (not as torch.distributed's default
group), so a job can tear one generation down and build the next in the
same process, and a user's own torch.distributed setup is left alone.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ._pg import ProcessGroupBackend
from .base import BackendError
from .gloo_listener import check_eager, closing_listeners

__all__ = ["GlooBackend"]


class GlooBackend(ProcessGroupBackend):
    """Collectives on CPU tensors over a Gloo process group.

    Args:
        store: the store the ranks rendezvous through (already prefixed
            with the generation).
        rank: this process's rank in the group.
        size: number of ranks.
        timeout: the longest any one collective may take.
        address: the interface address Gloo binds to (loopback in tests).
    """

    name = "gloo"

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 address: str = "127.0.0.1") -> None:
        try:
            check_eager()
        except ValueError as exc:
            raise BackendError(f"gloo: {exc}") from exc
        # Every pair is connected once the group is built: from then on the
        # listener would only serve strangers, so it is closed on the way out.
        with closing_listeners(address) as closed:
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
            opts._timeout = timeout
            try:
                pg = dist.ProcessGroupGloo(store, rank, size, opts)
            except RuntimeError as exc:
                raise BackendError(
                    f"gloo: could not connect rank {rank} of {size}: {exc}") from exc
        super().__init__(pg, rank, size)
        #: The listening addresses closed after set-up (for tests and logs).
        self.closed_listeners = closed
