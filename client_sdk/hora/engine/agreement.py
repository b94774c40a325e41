"""The global set's rounds: where ranks agree on what runs next, peer to peer.

Every rank with work enters a round with a :class:`ControlVector`: the slots
of the response cache whose tensor is ready here and those invalid here (any
other is not ready), how many coordinator response lists it has received,
whether its cache may be used, and rank 0's fusion threshold, cycle time and
mesh payload budget. Agreed (as the element-wise MIN of one value per slot
would be), they give every rank the same answer: run
the slots ready everywhere, drop the invalid ones, run the coordinator
lists every rank has. Ranks apply the same results in the same order, so
their caches never diverge.

The vectors travel through a :class:`.transport.ControlTransport`: over the
mesh in small worlds, with the bytes of ready tensors after them; through a
Gloo MIN-allreduce in large ones. :func:`.plan.plan_round` turns the agreed
vector into this rank's plan (evictions, batches and their backends, join,
coordinator lists); the round carries it out, the executor running each
batch (:meth:`.executor.Executor.allreduce`).

One thread at a time runs a round: a caller waiting on a handle
(:meth:`Agreement.drive`) or the background thread (:meth:`Agreement.loop`).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

import torch

from hora_native import BackendError
from hora_proto.v1 import negotiation_pb2

from .._ops import OpType
from ..errors import HorovodInternalError
from ..settings import Settings
from .cache import ResponseCache
from .control import ControlVector, peers_waiting_in
from .executor import Executor, TimelineRef
from .pending import Entry, Handle, Pending
from .plan import BackendSelector, Path, plan_round
from .process_sets import ResponseList
from .telemetry import TELEMETRY
from .transport import Carried, ControlTransport
from .tuning import CachedPathTuning

__all__ = ["Agreement", "ControlVector"]

log = logging.getLogger("hora")

# The background thread lets a burst of submissions end (none for QUIET_S,
# or BURST_S after its first) before it starts a round; a waiting caller runs
# one at once. Rounds per few tensors held the GIL the submitting thread
# needed (bench/README.md, "The per-tensor path"). A backward pass pauses
# for a millisecond now and then (a larger layer, the scheduler, the garbage
# collector): with a 1 ms window, rounds of a few of its gradients ran
# beside it, and a step of 400 small gradients took 11 % longer than with 5 ms
# (bench/README.md, "Third pass").
QUIET_S = 0.005
BURST_S = 0.05


class Agreement:
    """The response cache and the rounds that run the global set's work."""

    def __init__(self, settings: Settings, rank: int, size: int, pending: Pending,
                 executor: Executor, send: Callable[[negotiation_pb2.TensorRequest], None],
                 control: Callable[[ResponseCache], ControlTransport],
                 selector: BackendSelector, timeline: TimelineRef) -> None:
        self.rank = rank
        self.size = size
        self._settings = settings
        self._pending = pending
        self._lock = pending.lock
        self._work = pending.work
        self._executor = executor
        self._send = send
        self._selector = selector
        self._timeline = timeline
        self.cache = ResponseCache(settings.cache_capacity)
        self._control = control(self.cache)
        self._cache_on = settings.cache_capacity > 0
        self._cached_pending: dict[int, Entry] = {}
        self._unclassified: list[Entry] = []
        self._invalid_slots: set[int] = set()
        self._join: Entry | None = None
        self._join_announced = False
        # Joins completed in this world: every rank counts each at the same
        # round (a DistributedOptimizer checks its gradients again after one).
        self.joins = 0
        # Coordinator lists waiting for a round, and how many came and ran.
        self._lists: collections.deque[ResponseList] = collections.deque()
        self._received = 0
        self._executed = 0
        self.rounds = 0
        self.mesh_batches = 0  # batches reduced from payloads the rounds carried
        self._round_busy = False
        self._waiting_drivers = 0
        # When the newest cacheable entry came, and when the burst it belongs to began.
        self._last_admit = 0.0
        self._burst_start = 0.0
        # Whether the background thread was woken for the entries now unclassified.
        self._woken = False
        self.tuning = CachedPathTuning(settings, rank)
        self._cycle_s = settings.cycle_time.total_seconds()
        # Until the first round has agreed on rank 0's budget, rounds carry no payload.
        self._agreed_budget = 0
        # This rank's wait in its previous round (µs), handed in with the next
        # one; -1 before the first (:mod:`.telemetry`).
        self._waited_us = -1
        TELEMETRY.new_world()

    # -- taking work (callers hold the lock) ------------------------------------

    def admit(self, entry: Entry) -> bool:
        """Takes a new global-set entry; False when it must go to the coordinator now."""
        if entry.op_type == OpType.JOIN:
            self._join = entry
            self._join_announced = False
            self._work.notify()
            return False
        if self._cache_on and entry.cacheable():
            # The round loop decides hit or miss: it owns the cache, and at
            # its round boundaries every rank's cache is the same.
            now = time.monotonic()
            self._last_admit = now
            if not self._unclassified:
                self._burst_start = now
                self._woken = False
            self._unclassified.append(entry)
            if not self._woken and not entry.waited:
                # The first of a burst wakes the background thread; the rest
                # would only wake it again (a thread switch per tensor). A
                # waited entry's caller runs the round itself: waking the
                # thread would only make the two contend for the GIL.
                self._woken = True
                self._work.notify()
            return True
        return False

    def receive_list(self, batch: ResponseList) -> None:
        """A global-set response list from the coordinator, to run in a round."""
        with self._lock:
            self._lists.append(batch)
            self._received += 1
            self._work.notify_all()

    def drop_all(self) -> None:
        """Forgets every cached entry waiting (the generation failed: the pending
        table fails their handles)."""
        self._cached_pending.clear()
        self._unclassified.clear()

    def _classify(self) -> list[Entry]:
        """Sorts new cacheable entries into cache hits; returns the misses to send.

        A cached name whose signature changed is announced invalid, so that
        every rank drops the slot and asks the coordinator again.
        """
        misses = []
        cache = self.cache
        for entry in self._unclassified:
            found = cache.lookup(entry.name) if self._cache_on else None
            if found is None:
                misses.append(entry)
                continue
            slot, signature = found
            # An invalid call must reach the coordinator on every rank: the
            # slot is dropped everywhere, so the valid ranks ask it too.
            if not entry.invalid:
                key = entry.quick_key()
                if cache.quick(slot) == key:
                    self._cached_pending[slot] = entry
                    continue
                if signature == entry.signature():
                    cache.record_quick(slot, key)
                    self._cached_pending[slot] = entry
                    continue
            self._invalid_slots.add(slot)
            misses.append(entry)
        TELEMETRY.cache(len(self._unclassified) - len(misses), len(misses))
        self._unclassified.clear()
        return misses

    def cached_stalls(self, limit: float) -> tuple[list[Entry], tuple[int, ...], str]:
        """Cached entries waiting longer than ``limit`` s (each reported once), the
        peers the round in progress waits for, and what the peers that came to the
        last round were ready with instead (:func:`.control.peers_waiting_in`)."""
        now = time.monotonic()
        with self._lock:
            stalled = [e for e in self._cached_pending.values()
                       if not e.stall_warned and now - e.enqueued_at > limit]
            for entry in stalled:
                entry.stall_warned = True
            waiting = self._control.waiting_for if stalled else ()
            # A peer's READY slots in the last exchange are still pending there:
            # no round has run them since.
            doing = peers_waiting_in(self._control.last_vectors, self.rank, set(self._cached_pending),
                                     self.cache.name) if stalled else ""
        return stalled, waiting, doing

    # -- who runs rounds --------------------------------------------------------

    def _needs_round(self) -> bool:
        """Whether this rank has something the other ranks must agree on."""
        return bool(self._cached_pending or self._invalid_slots
                    or self._received > self._executed
                    or (self._join is not None and not self._join_announced))

    def _has_work(self) -> bool:
        return bool(self._unclassified) or self._needs_round()

    def loop(self) -> None:
        """The background thread: runs rounds nobody waits for (gradients
        allreduced while the backward pass goes on, say), with grad mode off
        for good (see :meth:`Executor.run_safely`)."""
        torch.set_grad_enabled(False)
        while True:
            with self._lock:
                while self._round_busy or not self._has_work() or self._in_burst():
                    if self._pending.over():
                        return
                    self._work.wait(self._burst_wait())
                if self._pending.over():
                    return
                self._round_busy = True
            try:
                self._run_round(background=True)
            except BaseException:
                log.exception("rank %d: background round failed", self.rank)
                return

    def _in_burst(self) -> bool:
        """Whether submissions are still coming in a burst the background thread
        should let end first (only new tensors count: coordinator lists and
        invalid slots never wait)."""
        if not self._unclassified or self._needs_round():
            return False
        now = time.monotonic()
        return now - self._last_admit < QUIET_S and now - self._burst_start < BURST_S

    def _burst_wait(self) -> float:
        if self._round_busy or not self._unclassified:
            return 0.5
        now = time.monotonic()
        return max(1e-4, min(self._last_admit + QUIET_S, self._burst_start + BURST_S) - now)

    def drive(self, handle: Handle, deadline: float | None) -> None:
        """Runs rounds in the caller's thread until ``handle`` is done.

        One thread at a time runs rounds; the others wait for it. Returns
        early when the generation fails or stops, or at ``deadline`` (a
        monotonic time).
        """
        while not handle.done():
            with self._lock:
                while self._round_busy or not self._has_work():
                    if handle.done() or self._pending.over():
                        return
                    wait = 0.5
                    if deadline is not None:
                        wait = min(wait, deadline - time.monotonic())
                        if wait <= 0:
                            return
                    self._waiting_drivers += 1
                    try:
                        self._work.wait(wait)
                    finally:
                        self._waiting_drivers -= 1
                if handle.done() or self._pending.over():
                    return
                self._round_busy = True
            self._run_round(background=False)

    def _run_round(self, background: bool) -> None:
        """One round by the thread that claimed it; anything but a transport
        error (which _round handles) fails the generation, then goes up.

        A round cut short (Ctrl-C in a caller, a bug, a torch error) may leave
        a peer's message unread: later rounds could not be matched, and peers
        would wait for this rank's next round until the collective timeout.
        """
        try:
            # A caller inside torch.inference_mode() may drive the round: what
            # the engine makes (fusion buffers, outputs) stays normal tensors.
            with torch.inference_mode(False):
                self._round(background)
        except BaseException as exc:
            what = "the background round failed" if background else "a round was interrupted"
            self._pending.fail(HorovodInternalError(
                f"rank {self.rank}: {what} ({exc!r}); this generation cannot run further "
                f"collectives"))
            raise
        finally:
            self._end_round()

    def _end_round(self) -> None:
        with self._lock:
            self._round_busy = False
            # Wake whoever may go on: waiting callers (their handle may be
            # done, or work may be left) and the background thread.
            if self._waiting_drivers or self._has_work():
                self._work.notify_all()

    # -- one round --------------------------------------------------------------

    def _round(self, background: bool) -> None:
        with self._lock:
            misses = self._classify()
        for entry in misses:
            self._send(entry.request())
        with self._lock:
            if not self._needs_round():
                return  # only misses: the coordinator answers, then we meet
        if background and self._cycle_s > 0:
            time.sleep(self._cycle_s)  # let more tensors become ready, for fusion
        with self._lock:
            ready = sorted(self._cached_pending.items())
            invalid = sorted(self._invalid_slots)
            self._invalid_slots.clear()
            if invalid:  # a slot found stale here is invalid, not ready: nor packed
                stale = set(invalid)
                ready = [item for item in ready if item[0] not in stale]
            ready_slots = [slot for slot, _entry in ready]
            waited = max(self._waited_us, 0)
            vector = ControlVector(len(self.cache), ready_slots, invalid, self._received,
                                   self._cache_on and self._join is None,
                                   wait_us=waited, minus_wait_us=-waited)
            if self.rank == 0:
                vector.fusion_threshold_kib, vector.cycle_us = self.tuning.proposal()
                vector.payload_budget = self._control.budget
            if self._join is not None:
                self._join_announced = True
        arrived = time.monotonic()
        try:
            # A caller waits on this round in its own thread (not background): its
            # core has nothing else to run, so the exchange may spin (MeshTransport).
            agreed, carried = self._control.exchange(vector, ready, self._agreed_budget,
                                                     spin=not background)
        except BackendError as exc:
            self._pending.fail(HorovodInternalError(
                f"data plane failed on rank {self.rank} agreeing on ready tensors: {exc}"))
            return
        if self._waited_us >= 0:
            TELEMETRY.round(vector.wait_us, -agreed.minus_wait_us, agreed.wait_us)
        self._waited_us = int((time.monotonic() - arrived) * 1e6)
        self.rounds += 1
        self._timeline.current.cycle_start()
        self._cycle_s = agreed.cycle_us / 1e6
        self._executor.run_safely((), lambda: self._carry_out(agreed, carried))
        self._agreed_budget = agreed.payload_budget
        self.tuning.step()

    def _carry_out(self, agreed: ControlVector, carried: Carried | None) -> None:
        """Plans the agreed round (:func:`.plan.plan_round`) and runs the plan."""
        selector = self._selector
        selector.agree(agreed.payload_budget)
        with self._lock:
            plan = plan_round(agreed, self._cached_pending, self.cache.signature,
                              carried.carries if carried is not None else None,
                              pairwise=selector.pairwise_takes, cache_on=self._cache_on,
                              executed=self._executed)
            # 1. Slots some rank found stale: dropped; our own waiting tensors
            #    go to the coordinator instead.
            cached = self._cached_pending
            for slot in plan.evictions:
                self.cache.evict(slot)
                cached.pop(slot, None)
            ready_slots = [slot for slot, _sig, _entry in plan.ready]
            for slot in ready_slots:
                del cached[slot]
            self.cache.touch_all(ready_slots)
            timeline = self._timeline.current
            if timeline.active:
                for _slot, _sig, entry in plan.ready:
                    timeline.negotiate_end(entry.name)
                    timeline.start(entry.name, OpType.ALLREDUCE)
                    timeline.activity_start(entry.name, "QUEUE")
        for entry in plan.resends:
            self._send(entry.request())
        # 2. Slots ready everywhere, in batches: reduced from the payloads when
        #    every rank sent the tensor, else on the backend the selector picks
        #    (2 or 4 ranks on several machines swap between pairs of ranks over
        #    the mesh's connections: PairwiseAllreduce).
        for batch in plan.batches:
            items = batch.items
            entries = [entry for _slot, _sig, entry in items]
            self._pending.discard(entries)
            slots = tuple([slot for slot, _sig, _entry in items])
            sizes = [entry.buffer.nbytes for entry in entries]
            if batch.path is Path.CARRIED:
                assert carried is not None
                backend = carried.batch(list(zip(slots, sizes, strict=True)))
                self.mesh_batches += 1
            else:
                backend = selector.reducer(batch.path, items[0][1].device)
            # A cached slot's tensors keep its signature while the cache's
            # version stays: the slots stand for the batch's shapes.
            self._executor.allreduce(backend, entries, self.size, (self.cache.version, slots))
            self.tuning.count(sum(sizes))
        # 3. A rank has joined: stop using the cache until the join completes.
        if plan.cache_off:
            self._set_cache(False)
        # 4. Coordinator lists that every rank has received.
        for _ in range(plan.lists):
            with self._lock:
                batch_list = self._lists.popleft()
            self._executed += 1
            for response in batch_list:
                if response.type == negotiation_pb2.RESPONSE_TYPE_JOIN:
                    self._finish_join(response)
                else:
                    self._remember(response, self._executor.execute(response))

    # -- the cache --------------------------------------------------------------

    def _remember(self, response: negotiation_pb2.Response, entries: list[Entry]) -> None:
        """Caches a negotiated allreduce so that its next occurrence skips the coordinator."""
        if (not self._cache_on or response.type != negotiation_pb2.RESPONSE_TYPE_ALLREDUCE
                or response.process_set_id != 0 or response.join_fill):
            return
        if not entries or any(not e.cacheable() for e in entries):
            return
        resend = []
        with self._lock:
            for entry in entries:
                _, evicted = self.cache.put(entry.name, entry.signature())
                if evicted is not None:
                    waiting = self._cached_pending.pop(evicted, None)
                    if waiting is not None:
                        resend.append(waiting)
        for entry in resend:
            self._send(entry.request())

    def _set_cache(self, on: bool) -> None:
        resend = []
        with self._lock:
            self._cache_on = on and self._settings.cache_capacity > 0
            if not on:
                self.cache.clear()
                resend = list(self._cached_pending.values())
                self._cached_pending.clear()
        for entry in resend:
            self._send(entry.request())

    def _finish_join(self, response: negotiation_pb2.Response) -> None:
        """Every rank has joined: the join returns, and the cache is used again."""
        with self._lock:
            join, self._join = self._join, None
            if join is not None:
                self._pending.entries.pop(join.name, None)
            self.joins += 1
        if join is not None:
            self._executor.finish(join, response.last_joined_rank)
        self._set_cache(True)
