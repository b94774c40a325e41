"""One float32 tensor allreduced (sum, in place) and waited on, by size and rank count.

    python bench/allreduce.py        # driver: prints the markdown tables

hora runs ``hvd.allreduce_`` with a fixed name per size, Horovod the same
call, direct Gloo ``dist.all_reduce``. Tensors hold zeros so that thousands
of in-place sums never overflow.
"""

from __future__ import annotations

import common
from common import GLOO, HORA, HOROVOD, SETTINGS, fmt, ratio, size_label

KIB, MIB = 1 << 10, 1 << 20
SIZES = [4 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB]
QUICK_SIZES = [4 * KIB, 1 * MIB]
# Ops per timed repetition: enough that short ops dwarf the timer.
ITERS = {4 * KIB: 50, 64 * KIB: 30, 1 * MIB: 10, 16 * MIB: 3, 64 * MIB: 1}
WARMUP = 3
REPS = 3 if SETTINGS.quick else 5
# Interleaved launches per system; the 2-rank rows are the ones read for speed.
ROUNDS = {2: 1 if SETTINGS.quick else 2, 4: 1}


def worker(system: str, out: str, sizes: list[int]) -> None:
    import torch

    common.set_one_thread()
    comm = common.Comm(system)
    comm.init()
    result = {}
    for nbytes in sizes:
        tensor = torch.zeros(nbytes // 4, dtype=torch.float32)
        name = f"bench.allreduce.{nbytes}"
        times = common.time_reps(lambda t=tensor, n=name: comm.allreduce_(t, n),
                                 warmup=WARMUP, reps=REPS, iters=ITERS.get(nbytes, 5))
        result[str(nbytes)] = times
    common.write_result(out, comm.rank, result)
    comm.shutdown()


def busbw(nbytes: int, seconds: float | None, size: int) -> tuple[float | None, float | None]:
    """(algbw, busbw) in GB/s; busbw = algbw * 2(n-1)/n, what each link carries in a ring."""
    if seconds is None:
        return None, None
    alg = nbytes / seconds / 1e9
    return alg, alg * 2 * (size - 1) / size


def main() -> None:
    args = common.worker_args()
    args.add_argument("--sizes", type=int, nargs="*", default=None)
    ns = args.parse_args()
    sizes = ns.sizes or (QUICK_SIZES if SETTINGS.quick else SIZES)
    if ns.worker:
        worker(ns.worker, ns.out, sizes)
        return

    rank_counts = [2] if SETTINGS.quick else [2, 4]
    systems = SETTINGS.systems()
    args = ["--sizes", *map(str, sizes)]
    runs = {n: common.launch_rounds(systems, ROUNDS[n], __file__, n, lambda s: (args, []))
            for n in rank_counts}

    def seconds(system: str, n: int, nbytes: int) -> float | None:
        samples = common.pooled(runs[n].get(system, []), lambda r: r[str(nbytes)])
        return common.median(samples) if samples else None

    time_rows, bw_rows = [], []
    for n in rank_counts:
        for nbytes in sizes:
            t = {s: seconds(s, n, nbytes) for s in (HORA, GLOO, HOROVOD)}
            ms = {s: None if v is None else v * 1e3 for s, v in t.items()}
            diff = None if ms[HORA] is None or ms[GLOO] is None else ms[HORA] - ms[GLOO]
            time_rows.append([
                n, size_label(nbytes), fmt(ms[HORA], 3), fmt(ms[GLOO], 3),
                fmt(ms[HOROVOD], 3), fmt(diff, 3),
                ratio(t[GLOO], t[HORA]), ratio(t[HOROVOD], t[HORA]),
            ])
            bw = {s: busbw(nbytes, v, n) for s, v in t.items()}
            bw_rows.append([
                n, size_label(nbytes),
                fmt(bw[HORA][0], 3), fmt(bw[HORA][1], 3),
                fmt(bw[GLOO][0], 3), fmt(bw[GLOO][1], 3),
                fmt(bw[HOROVOD][0], 3), fmt(bw[HOROVOD][1], 3),
                ratio(bw[HORA][1], bw[GLOO][1]), ratio(bw[HORA][1], bw[HOROVOD][1]),
            ])
    failures = [r for by_system in runs.values() for rs in by_system.values()
                for r in rs if not r.ok]
    rounds = ", ".join(f"{ROUNDS[n]} at {n} ranks" for n in rank_counts)
    reps = (f"median of {REPS} repetitions after {WARMUP} warm-up ops in each of "
            f"the interleaved launches per system ({rounds})")
    common.emit(common.section(
        "1. allreduce of one float32 tensor, time per op (waited on)",
        common.table(
            ["ranks", "size", "hora ms", "Gloo ms", "Horovod ms", "hora − Gloo ms",
             "speed hora/Gloo", "speed hora/Horovod"],
            time_rows),
        [f"Each figure: {reps}; speed ratio = baseline time / hora time (> 1: hora faster)."],
        failures))
    common.emit(common.section(
        "1b. allreduce bandwidth (GB/s = 1e9 B/s)",
        common.table(
            ["ranks", "size", "hora algbw", "hora busbw", "Gloo algbw", "Gloo busbw",
             "Horovod algbw", "Horovod busbw", "busbw hora/Gloo", "busbw hora/Horovod"],
            bw_rows),
        ["algbw = tensor bytes / time; busbw = algbw × 2(n−1)/n."]))


if __name__ == "__main__":
    main()
