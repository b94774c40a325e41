"""Process sets as one rank sees them: their ranks, our place, their data planes.

The global set (id 0) runs its responses in the agreement rounds. Every
other set this rank belongs to runs its responses on its own thread, so
that a collective blocked in one set never holds up another.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from hora_native import Backend, backend_for_device, create_backend
from hora_proto.v1 import negotiation_pb2

from ..errors import HorovodInternalError

__all__ = ["ProcessSets", "SetGroup"]

log = logging.getLogger("hora")

ResponseList = list[negotiation_pb2.Response]


@dataclasses.dataclass(eq=False)
class SetGroup:
    """One process set as this rank sees it."""

    id: int
    ranks: tuple[int, ...]
    index: int | None  # our position in ``ranks``; None when we are not a member
    backends: dict[str, Backend] = dataclasses.field(default_factory=dict)
    queue: queue.SimpleQueue[ResponseList | None] | None = None
    thread: threading.Thread | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)


class ProcessSets:
    """The sets of one generation and the backends each has built.

    Args:
        rank, size: this rank and the world's size.
        store: the generation's store; each set's backends rendezvous under
            their own prefix of it.
        timeout: the data plane's collective timeout.
        address: the interface the data plane listens on.
        run_list: runs one response list of a non-global set (the executor).
    """

    def __init__(self, rank: int, size: int, store: dist.Store, timeout: timedelta,
                 address: str, run_list: Callable[[ResponseList], None]) -> None:
        self.rank = rank
        self._store = store
        self._timeout = timeout
        self._address = address
        self._run_list = run_list
        self._sets: dict[int, SetGroup] = {0: SetGroup(0, tuple(range(size)), rank)}

    def get(self, process_set_id: int) -> SetGroup:
        """The registered set ``process_set_id``.

        Raises:
            ValueError: no such set was added.
        """
        found = self._sets.get(process_set_id)
        if found is None:
            raise ValueError(f"process set {process_set_id} has not been added "
                             f"(or was removed); call hvd.add_process_set first")
        return found

    def registered(self) -> dict[int, tuple[int, ...]]:
        """The sets added in this generation, by id, with their ranks (not the global set)."""
        return {set_id: group.ranks for set_id, group in list(self._sets.items()) if set_id}

    def add(self, process_set_id: int, ranks: Sequence[int]) -> None:
        """Records a set the coordinator has accepted and builds its CPU data plane."""
        ranks = tuple(sorted(ranks))
        group = SetGroup(process_set_id, ranks,
                         ranks.index(self.rank) if self.rank in ranks else None)
        self._sets[process_set_id] = group
        if group.index is not None:
            self.backend("cpu", group)
            group.queue = queue.SimpleQueue()
            group.thread = threading.Thread(target=self._loop, args=(group,),
                                            name=f"hora-set-{process_set_id}", daemon=True)
            group.thread.start()

    def remove(self, process_set_id: int) -> bool:
        """Stops a set's thread and closes its backends; False when it was not there."""
        group = self._sets.pop(process_set_id, None)
        if group is None:
            return False
        if group.queue is not None and group.thread is not None:
            group.queue.put(None)
            group.thread.join(timeout=self._timeout.total_seconds())
        for backend in group.backends.values():
            backend.close()
        return True

    def deliver(self, process_set_id: int, responses: ResponseList) -> None:
        """Hands a non-global set's responses to its thread."""
        group = self._sets.get(process_set_id)
        if group is None or group.queue is None:
            log.error("rank %d: responses for process set %d, which it does not run",
                      self.rank, process_set_id)
            return
        group.queue.put(responses)

    def _loop(self, group: SetGroup) -> None:
        """Runs a set's responses in the order the coordinator sent them (grad
        mode off for good, as on the rounds' thread)."""
        assert group.queue is not None
        torch.set_grad_enabled(False)
        while True:
            batch = group.queue.get()
            if batch is None:
                return
            self._run_list(batch)

    def backend(self, device_type: str, group: SetGroup) -> Backend:
        """The set's backend for tensors on ``device_type``, built on first use."""
        name = backend_for_device(device_type)
        backend = group.backends.get(name)
        if backend is None:
            if group.index is None:
                raise HorovodInternalError(
                    f"rank {self.rank} got work for process set {group.id}, which it is not in")
            prefix = f"{name}/" if group.id == 0 else f"set{group.id}/{name}/"
            backend = create_backend(name, dist.PrefixStore(prefix, self._store), group.index,
                                     group.size, self._timeout, self._address)
            group.backends[name] = backend
        return backend

    def stop(self) -> list[threading.Thread]:
        """Tells every set thread to end; returns them, to be joined."""
        threads = []
        for group in self._sets.values():
            if group.queue is not None:
                group.queue.put(None)
                if group.thread is not None:
                    threads.append(group.thread)
        return threads

    def close(self) -> None:
        """Closes every set's backends."""
        for group in self._sets.values():
            for backend in group.backends.values():
                backend.close()
            group.backends.clear()
