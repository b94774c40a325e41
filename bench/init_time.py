"""Time from init to the first finished allreduce, in a fresh job each time.

    python bench/init_time.py

Each worker imports its library first (not timed), meets the other ranks
through files (so that process start-up skew is not counted, and no system
under test is used to align them), then times ``init`` plus one 4-byte
allreduce: ``hvd.init()`` for hora and Horovod, ``init_process_group`` (env://,
a TCPStore on 127.0.0.1 hosted by the launching process, as torchrun's agent
does) for Gloo. A job's figure is the slowest rank's.
"""

from __future__ import annotations

import time

import common
from common import GLOO, HORA, HOROVOD, SETTINGS, fmt, ratio

REPS = 1 if SETTINGS.quick else 3


def worker(system: str, out: str) -> None:
    rank, size = common.env_rank()
    import torch

    comm = common.Comm(system)
    common.set_one_thread()
    one = torch.ones(1)
    common.file_barrier(out, "start", rank, size)
    start = time.perf_counter()
    comm.init()
    comm.allreduce_(one, "bench.first")
    elapsed = time.perf_counter() - start
    common.write_result(out, rank, {"init_s": elapsed})
    comm.shutdown()


def main() -> None:
    ns = common.worker_args().parse_args()
    if ns.worker:
        worker(ns.worker, ns.out)
        return
    rank_counts = [2] if SETTINGS.quick else [2, 4]
    systems = SETTINGS.systems()
    init: dict[tuple[str, int], list[float]] = {}
    wall: dict[tuple[str, int], list[float]] = {}
    failures = []
    # Systems interleaved within each repetition, so that noise spreads evenly.
    for n in rank_counts:
        for _ in range(REPS):
            for s in systems:
                run = common.launch(s, __file__, n)
                if not run.ok:
                    failures.append(run)
                    continue
                init.setdefault((s, n), []).append(max(r["init_s"] for r in run.ranks))
                wall.setdefault((s, n), []).append(run.wall_s)

    def med(values: dict[tuple[str, int], list[float]], s: str, n: int,
            scale: float) -> float | None:
        got = values.get((s, n))
        return common.median(got) * scale if got else None

    rows, wall_rows = [], []
    for n in rank_counts:
        ms = {s: med(init, s, n, 1e3) for s in (HORA, GLOO, HOROVOD)}
        rows.append([n, fmt(ms[HORA], 1), fmt(ms[GLOO], 1), fmt(ms[HOROVOD], 1),
                     ratio(ms[GLOO], ms[HORA]), ratio(ms[HOROVOD], ms[HORA])])
        sec = {s: med(wall, s, n, 1) for s in (HORA, GLOO, HOROVOD)}
        wall_rows.append([n, fmt(sec[HORA], 2), fmt(sec[GLOO], 2), fmt(sec[HOROVOD], 2),
                          ratio(sec[GLOO], sec[HORA]), ratio(sec[HOROVOD], sec[HORA])])
    common.emit(common.section(
        "4. time from init to the first finished 4-byte allreduce",
        common.table(["ranks", "hora ms", "torch.distributed Gloo ms", "Horovod ms",
                      "speed hora/Gloo", "speed hora/Horovod"], rows),
        [f"Slowest rank of each job; median of {REPS} fresh jobs. Speed ratio = baseline "
         "time / hora time (> 1: hora faster)."],
        failures))
    common.emit(common.section(
        "4b. whole job, launch to exit (context for section 4)",
        common.table(["ranks", "horarun s", "plain processes + Gloo s", "horovodrun s",
                      "speed hora/Gloo", "speed hora/Horovod"], wall_rows),
        ["Wall time of the launcher command: interpreter and torch start-up, init, one "
         "allreduce, shutdown. Not a target; it shows what the launcher adds."]))


if __name__ == "__main__":
    main()
