"""Keeping CPython's full collections off the serving path, without keeping garbage.

Each open stream holds about a hundred objects the cyclic GC tracks (grpc.aio's
call state, tasks, futures): at 10,000 members that is about a million, and
every full collection stalled the event loop for about a second, twenty-six
times a minute (bench/README.md). So objects that live past a quarter of a
second are frozen (``gc.freeze``: the GC no longer scans them; reference
counting still frees them), young collections stay cheap and full ones find
little to scan.

Frozen cycles are never collected, though: a call refused or finished just
after a freeze leaves its cycles (exception, traceback, frames) in the frozen
heap. A flood of 100k refused calls grew the coordinator from 141 to 403 MB
that way (issue 25). Hence two rules:

* young generations are collected before each freeze, so that cycles that are
  already garbage are freed, not frozen;
* the frozen heap is measured after every full collection, and between them
  whenever what was frozen since could have grown it enough; once it has grown
  by a quarter (and at least ``_MIN_GROWTH`` objects) a full collection runs
  early. A steady coordinator, whose frozen heap stays the size of its live
  state, still collects in full only every ``_GC_FULL_S``; one that piles
  garbage up pays a full collection per quarter of growth, as CPython's own
  heuristic would, so what it keeps is bounded by its live state.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys

__all__ = ["tame_gc"]

logger = logging.getLogger("hora_coordinator")

# How often the heap is frozen, and how often it is thawed for one full collection.
_GC_FREEZE_S = 0.25
_GC_FULL_S = 600.0
# Growth of the frozen heap, past its size after the last full collection, that
# calls for the next one early: a quarter of it, and at least this many objects.
_GROWTH_FRACTION = 0.25
_MIN_GROWTH = 20_000


# CPython 3.14's incremental collector is not the generational one
# ``_freeze_young`` counts with.
_THREE_GENERATIONS = (sys.implementation.name == "cpython"
                      and (3, 10) <= sys.version_info[:2] <= (3, 13))


def _full_collection() -> int:
    """Thaws, collects everything, freezes what lives; the frozen heap's size."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _freeze_young() -> int:
    """Collects the young generations and freezes what outlived them; about how
    many objects that froze. After ``gc.collect(1)`` the young generations are
    empty and the old one holds everything tracked since the last freeze (its
    survivors, and what automatic collections promoted), so counting it costs
    what it numbers, where ``gc.get_freeze_count()`` walks the whole frozen
    heap. That holds for CPython's three generations (3.10-3.13, checked on
    3.11); on any other collector, whose generations may differ, the count is
    unknown (``sys.maxsize``) and the next tick walks the frozen heap, as
    every tick did before."""
    gc.collect(1)
    if not _THREE_GENERATIONS:
        gc.freeze()
        return sys.maxsize
    added = len(gc.get_objects(generation=2))
    gc.freeze()
    return added


async def tame_gc(freeze_s: float = _GC_FREEZE_S, full_s: float = _GC_FULL_S) -> None:
    """Freezes the heap every ``freeze_s`` and collects in full every ``full_s``,
    or sooner when garbage piles up in the frozen heap (module docstring).

    The frozen heap is walked to count it only when what was frozen since the
    last count could have grown it past the threshold: frozen objects that
    reference counting freed leave it, so the sum of what each freeze added
    bounds its growth. An idle coordinator never walks it; one whose heap
    churns walks it once per threshold's worth of objects frozen.
    """
    loop = asyncio.get_running_loop()
    last_full = loop.time()
    await asyncio.sleep(freeze_s)
    _freeze_young()
    baseline = counted = gc.get_freeze_count()  # what serving holds at start
    added = 0  # frozen since the heap was last counted
    while True:
        await asyncio.sleep(freeze_s)
        threshold = max(_MIN_GROWTH, _GROWTH_FRACTION * baseline)
        grown = False
        if counted + added - baseline > threshold:
            counted, added = gc.get_freeze_count(), 0
            grown = counted - baseline > threshold
        if grown or loop.time() - last_full > full_s:
            frozen = counted + added
            started = loop.time()
            baseline = counted = _full_collection()
            added = 0
            last_full = loop.time()
            log = logger.info if last_full - started > 0.1 else logger.debug
            log("hora-coordinator: full garbage collection took %.2f s (%s; about %d objects "
                "frozen before, %d after)", last_full - started,
                "frozen heap grew" if grown else "periodic", frozen, baseline)
            continue
        added += _freeze_young()
