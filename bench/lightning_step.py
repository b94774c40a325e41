"""PyTorch Lightning training step: hora's strategy against Lightning's DDP over Gloo.

    python bench/lightning_step.py

The same LightningModule, the same Trainer settings and the same 2 processes;
only the strategy differs: ``Trainer(strategy="horovod")`` under ``horarun``
(hora.lightning: DistributedOptimizer on hora's engine) against
``Trainer(strategy="ddp")``, Lightning's DistributedDataParallel over Gloo,
started as plain processes meeting through torch's TCPStore (env://). The
models are section 3's, on a fixed random batch of 64 per process. A step
is what the user sees in Lightning: from one ``on_train_batch_end`` to the
next (loading the batch, forward, backward, gradient allreduce, SGD step and
Lightning's own bookkeeping).
"""

from __future__ import annotations

import time

import common
from common import GLOO, HORA, SETTINGS, fmt, ratio
from train_step import build

BATCH = 64
RANKS = 2
MODELS = ["cnn", "mlp"]
WARMUP = 2 if SETTINGS.quick else 3
REPS = 2 if SETTINGS.quick else 3
STEPS_PER_REP = 3 if SETTINGS.quick else 4
ROUNDS = 1 if SETTINGS.quick else 2
SYSTEMS = [HORA, GLOO]
LABEL = {HORA: "hora strategy='horovod'", GLOO: "Lightning strategy='ddp' (Gloo)"}


def lightning_available() -> bool:
    try:
        import lightning.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def worker(system: str, out: str) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F

    if system == HORA:
        import hora.lightning  # noqa: F401 - registers strategy="horovod"
    common.set_one_thread()
    rank, _ = common.env_rank()
    steps = WARMUP + REPS * STEPS_PER_REP

    class FixedBatches(torch.utils.data.Dataset):
        """The same batch every step (batch_size=None: the loader passes it as is)."""

        def __init__(self, shape: tuple[int, ...]) -> None:
            gen = torch.Generator().manual_seed(0)
            self.data = torch.randn(BATCH, *shape, generator=gen)
            self.target = torch.randint(0, 1000, (BATCH,), generator=gen)

        def __len__(self) -> int:
            return steps * RANKS

        def __getitem__(self, index: int):
            return self.data, self.target

    class Module(pl.LightningModule):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.model, self.shape = build(name)

        def training_step(self, batch, batch_idx):
            data, target = batch
            return F.cross_entropy(self.model(data), target)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class StepClock(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.ends.append(time.perf_counter())

    result = {}
    for name in MODELS:
        torch.manual_seed(0)
        module = Module(name)
        clock = StepClock()
        if system == HORA:
            strategy, devices = "horovod", 1
        else:
            strategy, devices = "ddp", RANKS
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices,
                             max_steps=steps, callbacks=[clock], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0)
        loader = torch.utils.data.DataLoader(FixedBatches(module.shape), batch_size=None)
        trainer.fit(module, loader)
        ends = clock.ends[WARMUP - 1:]  # the first timed step starts at the last warm-up end
        times = [(ends[(i + 1) * STEPS_PER_REP] - ends[i * STEPS_PER_REP]) / STEPS_PER_REP
                 for i in range(REPS)]
        result[name] = {"step": times, "params": sum(p.numel() for p in module.parameters()),
                        "world": trainer.world_size}
    common.write_result(out, rank, result)


def main() -> None:
    ns = common.worker_args().parse_args()
    if ns.worker:
        worker(ns.worker, ns.out)
        return
    title = f"3d. PyTorch Lightning training step, {RANKS} processes, batch {BATCH} per process"
    if not lightning_available():
        common.emit(common.section(title, "_PyTorch Lightning is not installed: not measured "
                                   "(pip install 'hora[lightning]')._",
                                   compares_horovod=False))
        return
    runs = common.launch_rounds(SYSTEMS, ROUNDS, __file__, RANKS)

    def throughput(system: str, model: str) -> float | None:
        samples = common.pooled(runs.get(system, []), lambda r: r[model]["step"])
        return BATCH * RANKS / common.median(samples) if samples else None

    rows = []
    for model in MODELS:
        sps = {s: throughput(s, model) for s in SYSTEMS}
        info = next((r.rank0[model] for rs in runs.values() for r in rs if r.ok), {})
        params = f"{info['params'] / 1e6:.2f}M" if info else common.MISSING
        step_ms = {s: (None if v is None else 1000 * BATCH * RANKS / v) for s, v in sps.items()}
        rows.append([model.upper(), params, fmt(sps[HORA], 0), fmt(sps[GLOO], 0),
                     fmt(step_ms[HORA], 1), fmt(step_ms[GLOO], 1), ratio(sps[HORA], sps[GLOO])])
    failures = [r for rs in runs.values() for r in rs if not r.ok]
    common.emit(common.section(
        title,
        common.table(["model", "params", f"{LABEL[HORA]} samples/s",
                      f"{LABEL[GLOO]} samples/s", "hora ms/step", "DDP ms/step",
                      "speed hora/DDP"], rows),
        [f"The same LightningModule and Trainer; samples/s over both processes, from the "
         f"median step time (one on_train_batch_end to the next) of {REPS} repetitions of "
         f"{STEPS_PER_REP} steps after {WARMUP} warm-up steps in each of {ROUNDS} interleaved "
         "launches per strategy. Target: hora/DDP >= 1.0."],
        failures, compares_horovod=False))


if __name__ == "__main__":
    main()
