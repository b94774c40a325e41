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
* the frozen heap is measured after every full collection; once it has grown
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

__all__ = ["tame_gc"]

logger = logging.getLogger("hora_coordinator")

# How often the heap is frozen, and how often it is thawed for one full collection.
_GC_FREEZE_S = 0.25
_GC_FULL_S = 600.0
# Growth of the frozen heap, past its size after the last full collection, that
# calls for the next one early: a quarter of it, and at least this many objects.
_GROWTH_FRACTION = 0.25
_MIN_GROWTH = 20_000


def _full_collection() -> int:
    """Thaws, collects everything, freezes what lives; the frozen heap's size."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def tame_gc(freeze_s: float = _GC_FREEZE_S, full_s: float = _GC_FULL_S) -> None:
    """Freezes the heap every ``freeze_s`` and collects in full every ``full_s``,
    or sooner when garbage piles up in the frozen heap (module docstring)."""
    loop = asyncio.get_running_loop()
    last_full = loop.time()
    await asyncio.sleep(freeze_s)
    gc.collect(1)
    gc.freeze()
    baseline = gc.get_freeze_count()  # what serving holds at start
    while True:
        await asyncio.sleep(freeze_s)
        frozen = gc.get_freeze_count()
        grown = frozen - baseline > max(_MIN_GROWTH, _GROWTH_FRACTION * baseline)
        if grown or loop.time() - last_full > full_s:
            started = loop.time()
            baseline = _full_collection()
            last_full = loop.time()
            log = logger.info if last_full - started > 0.1 else logger.debug
            log("hora-coordinator: full garbage collection took %.2f s (%s; %d objects "
                "frozen before, %d after)", last_full - started,
                "frozen heap grew" if grown else "periodic", frozen, baseline)
            continue
        gc.collect(1)
        gc.freeze()
