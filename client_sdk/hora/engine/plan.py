"""A round's plan: what the agreed control vector means for this rank.

:func:`plan_round` is pure: it reads the agreed vector, the cache and the
cached entries waiting here, and returns a frozen :class:`RoundPlan` (slots
to evict, entries to send to the coordinator again, fusion batches with the
path each takes, whether the cache goes off, how many coordinator lists
run). No I/O, no collectives, no threads: the agreement's round carries the
plan out (:meth:`.agreement.Agreement._carry_out`).

:class:`BackendSelector` picks the backend of an allreduce by one rule, for
the cached and the negotiated paths alike (:func:`choose_path`).
"""

from __future__ import annotations

import dataclasses
import enum
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from hora_native import Reducer

from .._ops import dtype_name
from .cache import Signature, fusion_fields
from .control import ControlVector
from .pending import Entry

if TYPE_CHECKING:
    from hora_native.mesh import PairwiseAllreduce

    from .process_sets import ProcessSets, SetGroup

__all__ = ["Batch", "BackendSelector", "Path", "Ready", "RoundPlan", "Takes", "choose_path",
           "plan_round"]

#: A cached tensor ready on every rank: (slot, its cached signature, this rank's entry).
Ready = tuple[int, Signature, Entry]


class Path(enum.Enum):
    """Which backend a batch's allreduce runs on."""

    CARRIED = "carried"    # reduced from the payloads the round's exchange carried
    PAIRWISE = "pairwise"  # swaps between pairs of ranks over the mesh (2 or 4 ranks)
    SET = "set"            # the process set's backend for the device (Gloo, NCCL, xccl)


#: Whether the pairwise mesh reduces a dtype (wire name); None while it is off.
Takes = Callable[[str], bool] | None


def choose_path(set_id: int, device: str, dtype: str, pairwise: Takes) -> Path:
    """The one rule for a batch the round did not carry: the pairwise mesh when
    it is on (it exists and the agreed payload budget is above 0) and takes
    this set, device and dtype, else the set's backend."""
    if pairwise is not None and set_id == 0 and device == "cpu" and pairwise(dtype):
        return Path.PAIRWISE
    return Path.SET


@dataclasses.dataclass(frozen=True, slots=True)
class Batch:
    """Tensors that share one fusion buffer, in slot order, and their path."""

    path: Path
    items: list[Ready]


@dataclasses.dataclass(frozen=True, slots=True)
class RoundPlan:
    """What one agreed round does on this rank, in order.

    Attributes:
        evictions: cache slots some rank found stale, to drop.
        resends: this rank's entries waiting in evicted slots: to the coordinator.
        ready: the cached entries ready everywhere (their slots are touched).
        batches: ``ready`` in fusion batches, carried ones first.
        cache_off: a rank has joined: the cache goes off until the join completes.
        lists: how many coordinator lists every rank has and this rank runs now.
    """

    evictions: tuple[int, ...]
    resends: tuple[Entry, ...]
    ready: list[Ready]
    batches: list[Batch]
    cache_off: bool
    lists: int


def plan_round(agreed: ControlVector, cached: Mapping[int, Entry],
               signature: Callable[[int], Signature], carries: Callable[[int], bool] | None,
               *, pairwise: Takes, cache_on: bool, executed: int) -> RoundPlan:
    """The plan of one round (pure: reads its arguments, changes nothing).

    Args:
        agreed: every rank's control vector, agreed (:meth:`.control.ControlVector.agree`).
        cached: this rank's cached entries waiting, by slot.
        signature: a cached slot's signature (the cache before this round).
        carries: whether every rank's payload carried a slot (None: the round
            carried no payloads).
        pairwise: what the pairwise mesh takes, None while it is off (see
            :func:`choose_path`).
        cache_on: whether this rank's cache is on.
        executed: how many coordinator lists this rank has run.
    """
    evictions = []
    resends = []
    ready: list[Ready] = []
    for slot in agreed.ready:
        entry = cached.get(slot)
        if entry is not None:  # else failed meanwhile; the rounds stop next
            ready.append((slot, signature(slot), entry))
    for slot in agreed.invalid:
        evictions.append(slot)
        entry = cached.get(slot)
        if entry is not None:
            resends.append(entry)
    batches: list[Batch] = []
    rest = ready
    if carries is not None and ready:
        carried: list[Ready] = []
        rest = []
        for item in ready:  # one pass: carried or not, in slot order
            (carried if carries(item[0]) else rest).append(item)
        if carried:
            _fuse(carried, sys.maxsize, batches, lambda _item: Path.CARRIED)
    if rest:
        def path(item: Ready) -> Path:
            return choose_path(0, item[1].device, item[1].dtype, pairwise)
        _fuse(rest, agreed.fusion_threshold_kib * 1024, batches, path)
    return RoundPlan(tuple(evictions), tuple(resends), ready, batches,
                     not agreed.cache_usable and cache_on,
                     max(0, agreed.lists_received - executed))


def _fuse(ready: list[Ready], threshold: int, out: list[Batch],
          path: Callable[[Ready], Path]) -> None:
    """Appends runs of ``ready`` (in slot order) that can share one fusion buffer: the
    same fusion key, at most ``threshold`` bytes (a larger tensor goes alone)."""
    i = 0
    while i < len(ready):
        key = fusion_fields(ready[i][1])
        nbytes = ready[i][2].buffer.nbytes
        j = i + 1
        while j < len(ready) and fusion_fields(ready[j][1]) == key:
            nbytes += ready[j][2].buffer.nbytes
            if nbytes > threshold:
                break
            j += 1
        out.append(Batch(path(ready[i]), ready[i:j]))
        i = j


class BackendSelector:
    """The backend an allreduce runs on, by :func:`choose_path`, on both paths.

    Args:
        sets: the generation's process sets (their Gloo/NCCL/xccl backends).
        pairwise: the mesh's pairwise allreduce (2 or 4 ranks on several
            machines), or None.
    """

    def __init__(self, sets: ProcessSets, pairwise: PairwiseAllreduce | None) -> None:
        self.sets = sets
        self._pairwise = pairwise
        # Set by each round from the agreed payload budget, the same on every rank.
        self.pairwise_takes: Takes = None

    def agree(self, payload_budget: int) -> None:
        """The round's agreed payload budget (rank 0's): 0 turns the pairwise mesh off."""
        on = self._pairwise is not None and payload_budget > 0
        self.pairwise_takes = self._pairwise.takes if on and self._pairwise is not None else None

    def reducer(self, path: Path, device: str, group: SetGroup | None = None) -> Reducer:
        """The backend of ``path`` (not CARRIED: that one is the round's) in
        ``group`` (default: the global set)."""
        if path is Path.PAIRWISE:
            assert self._pairwise is not None
            return self._pairwise
        return self.sets.backend(device, group if group is not None else self.sets.get(0))

    def for_entries(self, entries: list[Entry], group: SetGroup) -> Reducer:
        """The backend of a negotiated allreduce of ``entries`` in ``group``."""
        buffer = entries[0].buffer
        device = buffer.device.type
        path = choose_path(group.id, device, dtype_name(buffer.dtype), self.pairwise_takes)
        return self.reducer(path, device, group)
