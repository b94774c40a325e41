"""Training step throughput on synthetic data, and hora's coordinator traffic per step.

    python bench/train_step.py

One step is forward, backward and SGD on a fixed random batch of 64 per
process. hora and Horovod wrap the optimizer in ``DistributedOptimizer``;
the torch baseline is ``DistributedDataParallel`` over Gloo; "1 process" is
plain torch without distribution, the base of the scaling efficiency.

hora's workers also read the coordinator's ``negotiation_messages`` counter
(``GET /api/v1/jobs/{job_id}``) after warm-up and after the timed steps.
"""

from __future__ import annotations

import json
import urllib.request
import uuid

import common
from common import GLOO, HORA, HOROVOD, SETTINGS, fmt, ratio

BATCH = 64
RANKS = 2
MODELS = ["cnn", "mlp"]
WARMUP = 2 if SETTINGS.quick else 3
REPS = 2 if SETTINGS.quick else 3
STEPS_PER_REP = 3 if SETTINGS.quick else 4
# Interleaved launches per system: the efficiency compares separate jobs, so
# a burst of outside load must not land on one of them only.
ROUNDS = 1 if SETTINGS.quick else 2


def build(name: str):
    """The models of examples/pytorch_synthetic_benchmark.py (1.25M and 5.2M params)."""
    import torch.nn as nn
    import torch.nn.functional as F

    class ConvNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
            self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
            self.fc1 = nn.Linear(64 * 16 * 16, 72)
            self.fc2 = nn.Linear(72, 1000)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.conv1(x)), 2)
            x = F.max_pool2d(F.relu(self.conv2(x)), 2)
            return self.fc2(F.relu(self.fc1(x.flatten(1))))

    if name == "cnn":
        return ConvNet(), (3, 64, 64)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 1024), nn.ReLU(),
                          nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1000))
    return model, (3, 32, 32)


def negotiation_messages(http_port: int, job_id: str) -> int:
    url = f"http://127.0.0.1:{http_port}/api/v1/jobs/{job_id}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return int(json.load(response)["negotiation_messages"])


def worker(system: str, out: str, http_port: int, job_id: str) -> None:
    import torch
    import torch.nn.functional as F

    common.set_one_thread()
    torch.manual_seed(0)
    comm = None if system == "single" else common.Comm(system)
    rank, size = 0, 1
    if comm is not None:
        comm.init()
        rank, size = comm.rank, comm.size
    result = {}
    for name in MODELS:
        model, shape = build(name)
        params = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size, momentum=0.9)
        if comm is not None and comm.hvd is not None:
            optimizer = comm.hvd.DistributedOptimizer(
                optimizer, named_parameters=model.named_parameters())
            comm.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        elif system == GLOO:
            model = torch.nn.parallel.DistributedDataParallel(model)
        data = torch.randn(BATCH, *shape)
        target = torch.randint(0, 1000, (BATCH,))

        def step(model=model, optimizer=optimizer, data=data, target=target) -> None:
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            optimizer.step()

        common.time_reps(step, warmup=WARMUP, reps=0, iters=0)
        counting = system == HORA and rank == 0 and http_port > 0
        before = negotiation_messages(http_port, job_id) if counting else 0
        times = common.time_reps(step, warmup=0, reps=REPS, iters=STEPS_PER_REP)
        after = negotiation_messages(http_port, job_id) if counting else 0
        result[name] = {"step": times, "params": params}
        if counting:
            result[name]["negotiation"] = [before, after]
        # A DDP model must go before its process group (see machine.md).
        del model, optimizer, step
    common.write_result(out, rank, result)
    if comm is not None:
        comm.shutdown()


def main() -> None:
    parser = common.worker_args()
    parser.add_argument("--http-port", type=int, default=0)
    parser.add_argument("--job-id", default="")
    ns = parser.parse_args()
    if ns.worker:
        worker(ns.worker, ns.out, ns.http_port, ns.job_id)
        return

    runs: dict[str, list[common.LaunchResult]] = {}
    for _ in range(ROUNDS):
        runs.setdefault("single", []).append(common.launch("single", __file__, 1))
        for s in SETTINGS.systems():
            if s == HORA:
                port, job_id = common.free_port(), f"bench-{uuid.uuid4().hex[:8]}"
                run = common.launch(
                    s, __file__, RANKS, ["--http-port", str(port), "--job-id", job_id],
                    launcher_args=["--coordinator-http-port", str(port), "--job-id", job_id])
            else:
                run = common.launch(s, __file__, RANKS)
            runs.setdefault(s, []).append(run)

    def throughput(system: str, model: str) -> float | None:
        samples = common.pooled(runs.get(system, []), lambda r: r[model]["step"])
        size = 1 if system == "single" else RANKS
        return BATCH * size / common.median(samples) if samples else None

    def warmup_messages(model: str) -> str:
        counts = [run.rank0[model]["negotiation"][0] for run in runs.get(HORA, []) if run.ok]
        return fmt(common.median(counts), 0) if counts else common.MISSING

    def messages_per_step(model: str) -> float | None:
        counts = [run.rank0[model]["negotiation"] for run in runs.get(HORA, []) if run.ok]
        if not counts:
            return None
        return sum(after - before for before, after in counts) / (
            len(counts) * REPS * STEPS_PER_REP)

    def efficiency(total: float | None, single: float | None) -> str:
        if total is None or single is None:
            return common.MISSING
        return f"{100 * total / (RANKS * single):.0f}%"

    rows, negotiation = [], []
    for model in MODELS:
        sps = {s: throughput(s, model) for s in ("single", HORA, GLOO, HOROVOD)}
        info = next((r.rank0[model] for rs in runs.values() for r in rs if r.ok), {})
        params = f"{info['params'] / 1e6:.2f}M" if info else common.MISSING
        rows.append([
            model.upper(), params, fmt(sps["single"], 0), fmt(sps[HORA], 0), fmt(sps[GLOO], 0),
            fmt(sps[HOROVOD], 0), ratio(sps[HORA], sps[GLOO]), ratio(sps[HORA], sps[HOROVOD]),
            efficiency(sps[HORA], sps["single"]), efficiency(sps[GLOO], sps["single"]),
            efficiency(sps[HOROVOD], sps["single"]),
        ])
        negotiation.append(fmt(messages_per_step(model), 1))
    failures = [r for rs in runs.values() for r in rs if not r.ok]
    common.emit(common.section(
        f"3. training step throughput, {RANKS} ranks, batch {BATCH} per process",
        common.table(
            ["model", "params", "1 process samples/s", "hora samples/s", "DDP samples/s",
             "Horovod samples/s", "hora/DDP", "hora/Horovod", "efficiency hora",
             "efficiency DDP", "efficiency Horovod"],
            rows),
        [f"Samples/s over all ranks, from the median step time of {REPS} repetitions of "
         f"{STEPS_PER_REP} steps after {WARMUP} warm-up steps in each of {ROUNDS} interleaved "
         "launches per system (1 process included). Efficiency = samples/s at "
         f"{RANKS} ranks / ({RANKS} × 1 process samples/s)."],
        failures))
    common.emit("\n".join([
        "## 3b. coordinator traffic (hora only)", "",
        common.table(["measurement", *(m.upper() for m in MODELS), "target"],
                     [["coordinator negotiation messages per step (after warm-up)",
                       *negotiation, "0"],
                      ["counter when warm-up ended (job total so far; shows it counts)",
                       *(warmup_messages(m) for m in MODELS), "—"]]),
        "",
        f"Counter `negotiation_messages` of `GET /api/v1/jobs/{{job_id}}`, read by rank 0 "
        f"before and after the {REPS * STEPS_PER_REP} timed steps of section 3 in each "
        f"of its {ROUNDS} hora launches (a fresh job each), divided by the step count.",
    ]) + "\n")


if __name__ == "__main__":
    main()
