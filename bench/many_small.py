"""100 float32 tensors of 4 KiB per step: all enqueued async, then all waited on.

    python bench/many_small.py

This is what a DistributedOptimizer does with a model of many small layers.
hora and Horovod may fuse the 100 tensors into one buffer; direct Gloo runs
them one by one (``async_op=True``, then ``wait()`` on each).
"""

from __future__ import annotations

import common
from common import GLOO, HORA, HOROVOD, SETTINGS, fmt, ratio

TENSORS = 100
NBYTES = 4 << 10
RANKS = 2
WARMUP = 3
REPS = 3 if SETTINGS.quick else 5
STEPS_PER_REP = 2 if SETTINGS.quick else 3
ROUNDS = 1 if SETTINGS.quick else 5  # interleaved launches per system


def worker(system: str, out: str) -> None:
    import torch

    common.set_one_thread()
    comm = common.Comm(system)
    comm.init()
    tensors = [torch.zeros(NBYTES // 4) for _ in range(TENSORS)]
    names = [f"bench.small.{i}" for i in range(TENSORS)]

    def step() -> None:
        handles = [comm.allreduce_async_(t, n) for t, n in zip(tensors, names, strict=True)]
        for handle in handles:
            comm.wait(handle)

    times = common.time_reps(step, warmup=WARMUP, reps=REPS, iters=STEPS_PER_REP)
    common.write_result(out, comm.rank, {"step": times})
    comm.shutdown()


def main() -> None:
    ns = common.worker_args().parse_args()
    if ns.worker:
        worker(ns.worker, ns.out)
        return
    runs = common.launch_rounds(SETTINGS.systems(), ROUNDS, __file__, RANKS)
    ms: dict[str, float | None] = {s: None for s in (HORA, GLOO, HOROVOD)}
    spread = {s: common.MISSING for s in (HORA, GLOO, HOROVOD)}
    for s, launches in runs.items():
        # Each launch's median, then the median of those: one launch that
        # met a burst of outside load moves the figure by one place only.
        medians = [common.median(r.rank0["step"]) * 1e3 for r in launches if r.ok]
        if medians:
            ms[s] = common.median(medians)
            spread[s] = f"{min(medians):.2f}-{max(medians):.2f}"
    row = [f"{TENSORS} × 4 KiB", RANKS, fmt(ms[HORA], 2), fmt(ms[GLOO], 2), fmt(ms[HOROVOD], 2),
           ratio(ms[GLOO], ms[HORA]), ratio(ms[HOROVOD], ms[HORA])]
    ranges = ", ".join(f"{common.NAMES[s]} {spread[s]}" for s in runs)
    common.emit(common.section(
        "2. many small tensors per step (all enqueued, then all waited on)",
        common.table(["workload", "ranks", "hora ms/step", "Gloo ms/step (one by one)",
                      "Horovod ms/step (fused)", "speed hora/Gloo", "speed hora/Horovod"],
                     [row]),
        [f"Median over {ROUNDS} interleaved launches per system of each launch's median of "
         f"{REPS} repetitions of {STEPS_PER_REP} steps after {WARMUP} warm-up steps (range "
         f"over launches, ms/step: {ranges}); speed ratio = baseline time / hora time "
         "(> 1: hora faster)."],
        [r for launches in runs.values() for r in launches if not r.ok]))


if __name__ == "__main__":
    main()
