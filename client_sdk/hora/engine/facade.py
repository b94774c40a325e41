"""The engine of one worker and one generation: the stages wired together.

A tensor's path (ARCHITECTURE.md follows one gradient file by file):

- :mod:`.pending`: the caller's :class:`~.pending.Entry` waits under its name.
- :mod:`.agreement`: a cached allreduce is agreed on peer to peer in a round
  (and its bytes may travel with the round, over the mesh);
- :mod:`.negotiator`: any other request goes to the coordinator, whose
  ordered answers come back on the stream;
- :mod:`.executor`: the answer runs on the data plane (fusion, scaling,
  op dispatch) and completes the handle;
- :mod:`.process_sets`: which ranks and backends a set has;
- :mod:`.liveness`: heartbeats and stall warnings.

A failure of the generation (lost rank, broken stream, data-plane error)
fails every pending handle and every later enqueue with the same error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from hora_proto.v1 import rendezvous_pb2

from .._client import CoordinatorLink
from .._shm import segment_prefix
from ..errors import HoraError, HorovodInternalError
from ..settings import Settings
from ..timeline import NULL_TIMELINE, NullTimeline, Timeline
from .agreement import Agreement
from .cache import ResponseCache
from .executor import Executor, TimelineRef
from .liveness import Liveness
from .negotiator import Negotiator
from .pending import Entry, Handle, Pending
from .plan import BackendSelector
from .process_sets import ProcessSets, SetGroup
from .transport import ControlTransport, GlooControl, MeshControl

__all__ = ["Engine"]


class Engine:
    """Negotiates and runs the collectives of one worker in one generation.

    Args:
        settings: the worker's settings.
        client: the coordinator client (the engine does not own it).
        world: this worker's world view for the generation.
        store: where the data plane bootstraps (the coordinator's key-value
            store); the engine keeps it alive.
    """

    def __init__(self, settings: Settings, client: CoordinatorLink,
                 world: rendezvous_pb2.WorldView, store: dist.Store) -> None:
        self.settings = settings
        self.world = world
        self.rank = world.rank
        self.size = world.size
        self._client = client
        self._pending = Pending(world.rank)
        # Heartbeats from the start: bootstrapping the data plane (every rank
        # must come) may take longer than a lease.
        self._liveness = Liveness(settings, client, world.generation, world.rank, self._pending)
        self._liveness.thread.start()
        try:
            self._build(store)
        except BaseException:
            self._pending.stopping.set()
            raise

    def _build(self, store: dist.Store) -> None:
        settings, world = self.settings, self.world
        # The Python store object must outlive every C++ wrapper around it:
        # torch's trampoline finds its methods through this reference.
        self._base_store = store
        store = dist.PrefixStore(world.store_prefix, store)
        address = world.members[world.rank].data_plane_address or settings.data_plane_address
        self._sets = ProcessSets(world.rank, world.size, store, settings.collective_timeout,
                                 address, run_list=lambda batch: self._executor.run_list(batch))
        self._sets.backend("cpu", self._sets.get(0))  # every rank builds the CPU data plane
        from hora_native.mesh import MAX_MESH_SIZE, MeshBackend

        # Rounds agree over direct connections in small worlds (one TCP round
        # trip), through a Gloo allreduce in large ones.
        mesh = None
        if 1 < world.size <= MAX_MESH_SIZE:
            mesh = MeshBackend(
                dist.PrefixStore("ctl/", store), world.rank, world.size,
                settings.collective_timeout, address,
                shared_memory=settings.shm_allreduce_bytes > 0,
                shm_prefix=segment_prefix(settings.job_id),
                shm_bytes=settings.shm_allreduce_bytes,
                socket_bytes=settings.mesh_allreduce_bytes,
                # Peers prove the job token, bound to this job and generation.
                token=settings.token, context=world.store_prefix,
                local_ranks=world.local_size)
        self._mesh = mesh
        selector = BackendSelector(self._sets, mesh.pairwise if mesh is not None else None)
        self._timeline = TimelineRef()
        self._executor = Executor(world.rank, self._pending, self._sets, selector,
                                  self._timeline)
        if settings.timeline:
            self.start_timeline(settings.timeline, settings.timeline_mark_cycles)
        if mesh is not None:
            # A failed generation runs no more rounds: wake a round blocked on
            # a peer that will never answer (a stopped one keeps its sockets open).
            self._pending.on_fail.append(lambda: mesh.abort(str(self._pending.failure)))

        def control(cache: ResponseCache) -> ControlTransport:
            if mesh is not None:
                return MeshControl(mesh, cache)
            return GlooControl(self._sets)

        self.agreement = Agreement(settings, world.rank, world.size, self._pending,
                                   self._executor, send=lambda r: self._negotiator.send(r),
                                   control=control, selector=selector, timeline=self._timeline)
        self._pending.on_fail.append(self.agreement.drop_all)
        self._negotiator = Negotiator(settings, self._client, world.generation, world.rank,
                                      self._pending, self._executor, self._sets,
                                      on_global_list=self.agreement.receive_list,
                                      on_heartbeat=self._liveness.answered,
                                      timeline=self._timeline, reattach=self._reattach)
        self._liveness.attach(self._negotiator.heartbeat, self.agreement.cached_stalls)
        self._threads = [
            self._negotiator.thread,
            threading.Thread(target=self.agreement.loop, name="hora-rounds", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        self._threads.append(self._liveness.thread)

    def _reattach(self) -> bool:
        """Reports this member to the coordinator again after losing it (the
        negotiator's reader calls it); True when it rebuilt the job from reports."""
        return self._client.reattach(self.world, self._sets.registered(),
                                     self._liveness.host_epoch[0])

    @property
    def timeline(self) -> Timeline | NullTimeline:
        return self._timeline.current

    @property
    def rounds(self) -> int:
        return self.agreement.rounds

    @property
    def mesh_batches(self) -> int:
        return self.agreement.mesh_batches

    @property
    def pairwise_allreduces(self) -> int:
        """Batches allreduced by swaps between pairs of ranks instead of Gloo
        (2 or 4 ranks on several machines)."""
        pairwise = self._mesh.pairwise if self._mesh is not None else None
        return pairwise.allreduces if pairwise is not None else 0

    @property
    def resident_payloads(self) -> int:
        """Rounds whose payload this rank sent from a :meth:`shared_zeros` tensor."""
        return self._mesh.transport.resident_sends if self._mesh is not None else 0

    def shared_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A zeroed CPU tensor that the other ranks read in place when it is the
        whole of an allreduce (hora_native.mesh_resident): no copy into the
        round's payload. None unless every rank of the world shares this
        machine's /dev/shm, it has no room, or the tensor is smaller than
        copying it costs (64 KiB) or larger than a round's payload may be."""
        return self._mesh.resident_zeros(numel, dtype) if self._mesh is not None else None

    def enqueue(self, entry: Entry) -> Handle:
        """Submits ``entry`` for negotiation and returns its handle.

        Raises:
            InvalidCallError: a tensor with the same name is already in flight (a
                ValueError, as in Horovod, and a RuntimeError).
            HorovodInternalError: the generation has failed.
        """
        with self._pending.lock:
            self._pending.add(entry)
            if self._take(entry, self._timeline.current):
                return entry.handle
        self._negotiator.send(entry.request())
        return entry.handle

    def _take(self, entry: Entry, timeline: Timeline | NullTimeline) -> bool:
        """Hands a recorded entry to the rounds (True) or leaves it for the
        coordinator (False); call with the lock held."""
        if entry.process_set_id == 0:
            entry.handle.driver = self.agreement.drive
        if timeline.active:
            timeline.negotiate_start(entry.name, entry.op_type)
        return self.agreement.admit(entry)

    def enqueue_all(self, entries: Sequence[Entry]) -> None:
        """:meth:`enqueue` for each of ``entries`` under one lock round, all or
        none (a batch of gradients); each keeps its own handle.

        Raises:
            InvalidCallError, HorovodInternalError: as :meth:`enqueue`; then none
                of ``entries`` was submitted.
        """
        with self._pending.lock:
            self._pending.add_all(entries)
            timeline = self._timeline.current
            misses = [entry for entry in entries if not self._take(entry, timeline)]
        for entry in misses:
            self._negotiator.send(entry.request())

    def failure(self) -> HoraError | None:
        return self._pending.failure

    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        """Starts writing a Chrome trace to ``path`` (rank 0 only, as Horovod does)."""
        if self.rank != 0:
            return
        self.stop_timeline()
        self._timeline.current = Timeline(path, self.rank, mark_cycles=mark_cycles)

    def stop_timeline(self) -> None:
        timeline, self._timeline.current = self._timeline.current, NULL_TIMELINE
        timeline.close()

    def host_update_epoch(self) -> tuple[int, bool]:
        """The newest host-change epoch seen in heartbeats, and whether it only removed hosts."""
        return self._liveness.host_epoch

    def process_set(self, process_set_id: int) -> SetGroup:
        """The registered process set ``process_set_id`` (ValueError when unknown)."""
        return self._sets.get(process_set_id)

    def add_process_set(self, process_set_id: int, ranks: Sequence[int],
                        invalid: str = "") -> None:
        """Registers a set with the coordinator and builds its CPU data plane.

        A collective: every rank calls this, and the coordinator answers every
        rank alike once all have. ``invalid`` is this rank's own problem with
        the call; it fails the call on every rank.

        Raises:
            InvalidCallError: some rank's call was invalid, or the calls differ.
            StallError: some rank did not call within the stall shutdown time.
            RankLostError: a rank left or was lost while the call waited.
        """
        ranks = sorted(ranks)
        self._client.add_process_set(self.world.generation, process_set_id, ranks, invalid)
        self._sets.add(process_set_id, ranks)

    def remove_process_set(self, process_set_id: int, invalid: str = "") -> None:
        """Unregisters a set on every rank; a collective like :meth:`add_process_set`.

        ``process_set_id`` is -1 when this rank never added the set.
        """
        self._client.remove_process_set(self.world.generation, process_set_id, invalid)
        self._sets.remove(process_set_id)

    def shutdown(self, timeout: timedelta = timedelta(seconds=10), rejoin: bool = False) -> None:
        """Leaves the job (or, with ``rejoin``, this generation), stops the threads
        and releases the data plane."""
        if self._pending.stopping.is_set():
            return
        self._pending.stopping.set()
        self._client.leave(reason="reset" if rejoin else "shutdown", rejoin=rejoin)
        self._negotiator.close()
        self._pending.fail(HorovodInternalError("hora has been shut down"))
        threads = self._threads + self._sets.stop()
        deadline = time.monotonic() + timeout.total_seconds()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._sets.close()
        if self._mesh is not None:
            self._mesh.close()
        self.stop_timeline()

