"""Where Python overhead dominates: one waited-on 4 KiB allreduce next to the
floor (a 64-byte loopback round trip), and an optimizer step over 400 small
parameter tensors.

    python bench/small_ops.py

Section 2b: ``hvd.allreduce_`` of 4 KiB, waited on (hora, Horovod), direct
Gloo's ``dist.all_reduce``, and a 64-byte TCP ping-pong between two plain
processes on 127.0.0.1 (TCP_NODELAY), launched between them: what one
message there and back costs on this machine at this moment.

Section 2c: forward, backward and SGD over ``200 × Linear(64, 64)`` (400
parameter tensors of 16 KiB or 256 B) on a batch of 32 per process; hora and
Horovod wrap the optimizer in ``DistributedOptimizer``, the torch baseline is
``DistributedDataParallel`` over Gloo. Every system steps with subnormal floats
flushed to zero (see ``_steps``).
"""

from __future__ import annotations

import datetime
import socket

import common
from common import GLOO, HORA, HOROVOD, SETTINGS, fmt, ratio

RANKS = 2
NBYTES = 4 << 10
LAYERS, WIDTH, BATCH = 200, 64, 32
PING_BYTES = 64
WARMUP = 3
REPS = 3 if SETTINGS.quick else 5
OPS_PER_REP = 100 if SETTINGS.quick else 200
STEPS_PER_REP = 3 if SETTINGS.quick else 5
ROUNDS = 1 if SETTINGS.quick else 3  # interleaved launches per system
PING = "ping"  # the 64-byte round trip, two plain processes


def _ping_then_alone(out: str) -> None:
    """The floors, in two plain processes: a 64-byte round trip between them, then
    section 2c's step in each process at once with no communication at all."""
    import json
    import os

    from torch.distributed import TCPStore

    rank = int(os.environ["RANK"])
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), RANKS,
                     is_master=False, timeout=datetime.timedelta(seconds=60))
    rtt = _ping(store, rank)
    common.set_one_thread()
    store.set(f"alone.{rank}", "1")  # both start stepping together
    store.wait([f"alone.{r}" for r in range(RANKS)])
    alone = _steps(*_local_model())
    if rank == 1:
        store.set("ping.rtt", json.dumps(rtt))
        common.write_result(out, 1, {"alone": alone})
    else:
        common.write_result(out, 0, {"rtt": json.loads(store.get("ping.rtt")), "alone": alone})


def _ping(store, rank: int) -> list[float] | None:
    """Rank 0 listens, rank 1 sends 64 bytes and reads them back, many times;
    rank 1 returns the times."""
    if rank == 0:
        with socket.create_server(("127.0.0.1", 0)) as server:
            server.settimeout(60)
            store.set("ping.port", str(server.getsockname()[1]))
            conn, _ = server.accept()
            with conn:
                conn.settimeout(60)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while data := conn.recv(PING_BYTES):
                    conn.sendall(data)
        return None
    port = int(store.get("ping.port"))
    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        message = b"x" * PING_BYTES

        def round_trip() -> None:
            conn.sendall(message)
            got = 0
            while got < PING_BYTES:
                got += len(conn.recv(PING_BYTES - got))

        return common.time_reps(round_trip, warmup=100, reps=REPS, iters=OPS_PER_REP)


def _model():
    import torch.nn as nn

    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def _local_model():
    import torch

    torch.manual_seed(0)
    model = _model()
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _steps(model, optimizer) -> list[float]:
    """Section 2c's timed steps of ``model``."""
    import torch
    import torch.nn.functional as F

    # The 200-deep tanh chain's gradients shrink about 1.7-fold a layer back
    # from the loss, so those of its first 60 or so layers are subnormal
    # floats or zero (29 % of the 832,000 gradient elements).
    # Subnormal arithmetic is slow on x86, by a factor that depends on the
    # host: on one, a plain step took 45 ms with them and 14 ms without
    # (bench/README.md, "Twelfth pass"), and the floor then sat above DDP ÷
    # 1.5. Every system's step, and the floor's, flushes them to zero, so that
    # the section measures the collectives and not the host's subnormal penalty.
    torch.set_flush_denormal(True)
    data, target = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)

    def step() -> None:
        optimizer.zero_grad()
        F.mse_loss(model(data), target).backward()
        optimizer.step()

    return common.time_reps(step, warmup=WARMUP, reps=REPS, iters=STEPS_PER_REP)


def worker(system: str, out: str) -> None:
    import torch

    if system == "single":
        _ping_then_alone(out)
        return
    common.set_one_thread()
    torch.manual_seed(0)
    comm = common.Comm(system)
    comm.init()
    tensor = torch.zeros(NBYTES // 4)
    waited = common.time_reps(lambda: comm.allreduce_(tensor, "bench.small_ops.4k"),
                              warmup=WARMUP * 10, reps=REPS, iters=OPS_PER_REP)
    model, optimizer = _local_model()
    if comm.hvd is not None:
        optimizer = comm.hvd.DistributedOptimizer(optimizer,
                                                  named_parameters=model.named_parameters())
        comm.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    steps = _steps(model, optimizer)
    params = sum(1 for _ in model.parameters())
    common.write_result(out, comm.rank, {"waited": waited, "step": steps, "params": params})
    del model, optimizer  # a DDP model must go before its process group
    comm.shutdown()


def launch_medians(launches: list[common.LaunchResult], key: str) -> list[float]:
    """Rank 0's median of each successful launch, in ms."""
    return [common.median(r.rank0[key]) * 1e3 for r in launches if r.ok and r.rank0.get(key)]


def summary(medians: list[float], digits: int) -> tuple[float | None, str]:
    """The median of the launches' medians, and 'lo-hi' over the launches."""
    if not medians:
        return None, common.MISSING
    return common.median(medians), f"{fmt(min(medians), digits)}-{fmt(max(medians), digits)}"


def main() -> None:
    ns = common.worker_args().parse_args()
    if ns.worker:
        worker(ns.worker, ns.out)
        return
    systems = [*SETTINGS.systems(), PING]
    runs: dict[str, list[common.LaunchResult]] = {s: [] for s in systems}
    for _ in range(ROUNDS):
        for s in systems:
            runs[s].append(common.launch("single" if s == PING else s, __file__, RANKS))
    wait = {s: summary(launch_medians(runs[s], "waited"), 3) for s in (HORA, GLOO, HOROVOD)
            if s in runs}
    rtt, rtt_range = summary(launch_medians(runs[PING], "rtt"), 3)
    hora_ms = wait[HORA][0]
    target = None if rtt is None else max(0.08, 1.5 * rtt)
    rows = [["hora", fmt(hora_ms, 3), wait[HORA][1], ratio(hora_ms, rtt)]]
    for s in (GLOO, HOROVOD):
        ms, spread = wait.get(s, (None, common.MISSING))
        rows.append([common.NAMES[s], fmt(ms, 3), spread, ratio(ms, rtt)])
    rows.append([f"{PING_BYTES}-byte loopback round trip (TCP, 2 processes)", fmt(rtt, 3),
                 rtt_range, "1.00" if rtt else common.MISSING])
    failures = [r for rs in runs.values() for r in rs if not r.ok]
    common.emit(common.section(
        f"2b. one waited-on 4 KiB allreduce against the loopback floor, {RANKS} ranks",
        common.table(["what", "ms per op", "range over launches", "× round trip"], rows),
        [f"Median over {ROUNDS} interleaved launches of each launch's median of {REPS} "
         f"repetitions of {OPS_PER_REP} ops. Target: hora ≤ max(0.08 ms, 1.5 × round trip) "
         f"= {fmt(target, 3)} ms."],
        failures))
    step = {s: summary(launch_medians(runs[s], "step"), 2) for s in (HORA, GLOO, HOROVOD)
            if s in runs}
    hora_step = step[HORA][0]
    params = next((r.rank0["params"] for r in runs[HORA] if r.ok), None)
    rows = []
    for s, label in ((HORA, "hora DistributedOptimizer"),
                     (GLOO, "torch DDP (Gloo)"), (HOROVOD, "Horovod DistributedOptimizer")):
        ms, spread = step.get(s, (None, common.MISSING))
        rows.append([label, fmt(ms, 2), spread, "1.00" if s == HORA else ratio(ms, hora_step)])
    alone, alone_spread = summary(launch_medians(runs[PING], "alone"), 2)
    rows.append(["no communication: the same step in 2 plain processes at once (the floor)",
                 fmt(alone, 2), alone_spread, ratio(alone, hora_step)])
    common.emit(common.section(
        f"2c. optimizer step over {LAYERS} × Linear({WIDTH}, {WIDTH}) "
        f"({params or 2 * LAYERS} parameter tensors), {RANKS} ranks, batch {BATCH}",
        common.table(["system", "ms per step", "range over launches",
                      "speed hora/system"], rows),
        [f"Median over {ROUNDS} interleaved launches of each launch's median of {REPS} "
         f"repetitions of {STEPS_PER_REP} steps after {WARMUP} warm-up steps. Target: "
         "hora ≥ 1.5 × DDP and ≥ 1.5 × Horovod. The floor row runs no collective at all: "
         "no system can step faster than it (DDP ÷ 1.5 below it is out of reach). "
         "Every row flushes subnormal floats to zero."],
        [r for r in failures if r.system != "single"]))


if __name__ == "__main__":
    main()
