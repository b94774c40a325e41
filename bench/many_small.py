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
ROUNDS = 1 if SETTINGS.quick else 2  # interleaved launches per system


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
    ms = {s: None for s in (HORA, GLOO, HOROVOD)}
    for s, launches in runs.items():
        samples = common.pooled(launches, lambda r: r["step"])
        ms[s] = common.median(samples) * 1e3 if samples else None
    row = [f"{TENSORS} × 4 KiB", RANKS, fmt(ms[HORA], 2), fmt(ms[GLOO], 2), fmt(ms[HOROVOD], 2),
           ratio(ms[GLOO], ms[HORA]), ratio(ms[HOROVOD], ms[HORA])]
    common.emit(common.section(
        "2. many small tensors per step (all enqueued, then all waited on)",
        common.table(["workload", "ranks", "hora ms/step", "Gloo ms/step (one by one)",
                      "Horovod ms/step (fused)", "speed hora/Gloo", "speed hora/Horovod"],
                     [row]),
        [f"Median of {REPS} repetitions of {STEPS_PER_REP} steps after {WARMUP} warm-up steps "
         f"in each of {ROUNDS} interleaved launches per system; speed ratio = baseline time / "
         "hora time (> 1: hora faster)."],
        [r for launches in runs.values() for r in launches if not r.ok]))


if __name__ == "__main__":
    main()
