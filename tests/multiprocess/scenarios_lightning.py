"""Lightning on hora: what each worker of tests/multiprocess/test_lightning.py runs.

Each function returns plain data (numbers, lists, numpy arrays) for the test
to compare across ranks and against a single-process reference.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.utils.data import DataLoader, TensorDataset

import hora.lightning
import hora.torch as hvd


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def make_data(samples: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randn(samples, 6, generator=gen),
                         torch.randint(0, 3, (samples,), generator=gen))


class Classifier(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = make_model()

    def training_step(self, batch, batch_idx):
        data, target = batch
        loss = torch.nn.functional.cross_entropy(self.net(data), target)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch, batch_idx):
        data, target = batch
        accuracy = (self.net(data).argmax(1) == target).float().mean()
        self.log("test_acc", accuracy, sync_dist=True)
        # Rank r logs r: the synced value is the mean of the ranks, not this rank's.
        self.log("rank_mean", float(self.global_rank), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class RecordingIO(TorchCheckpointIO):
    """Counts the checkpoints this rank writes."""

    def __init__(self) -> None:
        super().__init__()
        self.saved: list[str] = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.saved.append(str(path))
        super().save_checkpoint(checkpoint, path, storage_options)


def fit_and_test(root: str, batch: int, accumulate: int, epochs: int, samples: int) -> dict:
    """Fit with accumulation, then test; what each rank saw.

    groups=0: every gradient reduces as soon as backward makes it, through the
    optimizer's per-parameter delay counters (the default on GPUs; on CPU the
    default is one fused group, which examples/lightning_digits.py runs).
    """
    torch.manual_seed(100 + hvd.rank())  # different on every rank: fit broadcasts rank 0's
    module = Classifier(lr=0.1)
    # Rank 0's initial weights, for the test's single-process reference.
    initial = {k: v.clone().numpy() for k, v in module.net.state_dict().items()}
    recorder = RecordingIO()
    trainer = pl.Trainer(strategy=hora.lightning.HorovodStrategy(groups=0), max_epochs=epochs,
                         accumulate_grad_batches=accumulate,
                         default_root_dir=root, logger=CSVLogger(root), plugins=[recorder],
                         enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1)
    loader = DataLoader(make_data(samples), batch_size=batch, shuffle=False)
    trainer.fit(module, loader)
    fitted = {k: v.detach().clone().numpy() for k, v in module.net.state_dict().items()}
    train_loss = float(trainer.callback_metrics["train_loss"])
    tested = trainer.test(module, loader, verbose=False)[0]
    return {
        "strategy": type(trainer.strategy).__name__,
        "world": (trainer.global_rank, trainer.world_size, trainer.is_global_zero),
        "rank_zero_only": rank_zero_only.rank,
        "initial": initial,
        "fitted": fitted,
        "global_step": trainer.global_step,
        "checkpoints_saved": recorder.saved,
        "test": tested,
        "train_loss": train_loss,
    }


def strategy_collectives() -> dict:
    """HorovodStrategy(): the reduce / all_gather / barrier / broadcast hooks, called directly."""
    strategy = hora.lightning.HorovodStrategy(scale_lr=False)
    trainer = pl.Trainer(strategy=strategy, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False)
    rank = hvd.rank()
    value = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    out = {
        "same_object": trainer.strategy is strategy,
        "mean": strategy.reduce(value.clone()).tolist(),
        "sum": strategy.reduce(value.clone(), reduce_op="sum").tolist(),
        "sum_enum": strategy.reduce(value.clone(), reduce_op=ReduceOp.SUM).tolist(),
        "max": strategy.reduce(value.clone(), reduce_op="max").tolist(),
        "min": strategy.reduce(value.clone(), reduce_op=ReduceOp.MIN).tolist(),
        "not_a_tensor": strategy.reduce(7),
        "gathered": strategy.all_gather(torch.full((2,), float(rank))).tolist(),
        "gathered_scalar": strategy.all_gather(torch.tensor(float(rank))).tolist(),
        "broadcast": strategy.broadcast({"from": rank}, src=1),
        "all_true": strategy.reduce_boolean_decision(rank == 0, all=True),
        "any_true": strategy.reduce_boolean_decision(rank == 0, all=False),
        "sampler": strategy.distributed_sampler_kwargs,
    }
    with torch.inference_mode():
        # Lightning tests and validates in inference mode.
        out["inference_mean"] = strategy.reduce(torch.tensor([float(rank)])).tolist()
    strategy.barrier("end")
    return out


def fit_test_and_collectives(root: str, batch: int, accumulate: int, epochs: int,
                             samples: int) -> dict:
    """Both of the above in one pair of workers (Lightning takes seconds to import)."""
    return {"fit": fit_and_test(root, batch, accumulate, epochs, samples),
            "collectives": strategy_collectives()}
