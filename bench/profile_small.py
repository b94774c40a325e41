"""Where a small allreduce's microseconds go: cProfile over 100 × 4 KiB steps.

    .venv/bin/horarun -np 2 .venv/bin/python bench/profile_small.py

Each rank runs STEPS steps of 100 async in-place allreduces of 4 KiB, then
``synchronize`` on every handle, under cProfile: the caller's thread for the
whole step, the engine's background thread for the rounds it runs. Rank 0
prints the time per tensor in each stage of the path and the Python function
calls per tensor. Times under a profiler are inflated and move with the
machine's load; the call counts do not (bench/README.md, "The per-tensor path").
"""

from __future__ import annotations

import cProfile
import pstats
import threading
import time

import torch

import hora.torch as hvd
from hora import _runtime

TENSORS, NBYTES, WARMUP, STEPS = 100, 4 << 10, 20, 100

# (stage, file suffix, function); cumulative time, both threads together.
STAGES = [
    ("submission (allreduce_async_)", "torch/_collectives.py", "allreduce_async_"),
    ("  checks (tensor, set, op, device)", "torch/_validation.py", "_reduction_problem"),
    ("  entry and handle", "torch/_collectives.py", "_allreduce_entry"),
    ("  enqueue (lock, pending table, admit)", "engine/facade.py", "enqueue"),
    ("synchronize (waits, or runs the round)", "torch/_basics.py", "synchronize"),
    ("rounds, all threads (_run_round)", "engine/agreement.py", "_run_round"),
    ("  cache classification", "engine/agreement.py", "_classify"),
    ("  packing into the payload", "hora_native/mesh.py", "pack"),
    ("  agreement exchange (loopback)", "hora_native/mesh_transport.py", "exchange"),
    ("  reduction and unpacking (executor)", "engine/executor.py", "allreduce"),
    ("    reduction of the carried bytes", "hora_native/mesh.py", "allreduce"),
    ("    completion of the handles", "engine/executor.py", "finish_all"),
    ("    completion of the handles (one by one)", "engine/executor.py", "finish"),
]


def main() -> None:
    torch.set_num_threads(1)
    hvd.init()
    agreement = _runtime.current().engine.agreement
    tensors = [torch.zeros(NBYTES // 4) for _ in range(TENSORS)]
    names = [f"profile.small.{i}" for i in range(TENSORS)]

    def step() -> None:
        handles = [hvd.allreduce_async_(t, name=n, op=hvd.Sum)
                   for t, n in zip(tensors, names, strict=True)]
        for handle in handles:
            hvd.synchronize(handle)

    for _ in range(WARMUP):
        step()
    main_thread = threading.current_thread()
    in_background = cProfile.Profile()
    run_round = agreement._run_round

    def profiled_round(background: bool) -> None:
        if threading.current_thread() is main_thread:
            run_round(background)
            return
        in_background.enable()
        try:
            run_round(background)
        finally:
            in_background.disable()

    agreement._run_round = profiled_round  # type: ignore[method-assign]
    rounds = agreement.rounds
    caller = cProfile.Profile()
    start = time.perf_counter()
    caller.enable()
    for _ in range(STEPS):
        step()
    caller.disable()
    elapsed = time.perf_counter() - start
    rounds = agreement.rounds - rounds
    agreement._run_round = run_round  # type: ignore[method-assign]
    stats = pstats.Stats(caller)
    in_background.create_stats()
    if in_background.stats:  # type: ignore[attr-defined]
        stats.add(in_background)  # empty when the background thread ran no round
    if hvd.rank() == 0:
        report(stats, elapsed, rounds)
    hvd.shutdown()


def report(stats: pstats.Stats, elapsed: float, rounds: int) -> None:
    per = STEPS * TENSORS
    table: dict[tuple[str, int, str], tuple[int, int, float, float, dict]] = \
        stats.stats  # type: ignore[attr-defined]
    calls = sum(v[1] for v in table.values())
    print(f"{STEPS} steps of {TENSORS} x {NBYTES} B under cProfile: "
          f"{elapsed / STEPS * 1e3:.2f} ms/step, {rounds / STEPS:.2f} rounds/step, "
          f"{calls / per:.1f} Python function calls per tensor")
    print("| stage | calls per tensor | µs per tensor (cumulative) |")
    print("| --- | --- | --- |")
    for label, suffix, func in STAGES:
        found = [(v[1], v[3]) for (path, _line, name), v in table.items()
                 if name == func and path.endswith(suffix)]
        if not found:
            continue
        ncalls = sum(n for n, _t in found)
        cum = sum(t for _n, t in found)
        print(f"| {label} | {ncalls / per:.2f} | {cum / per * 1e6:.1f} |")


if __name__ == "__main__":
    main()
