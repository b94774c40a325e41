"""Train a small CNN on scikit-learn's bundled digits with PyTorch Lightning on hora.

    horovodrun -np 2 python examples/lightning_digits.py --epochs 8

The one line a Lightning user changes for Horovod is the strategy:
``Trainer(strategy="horovod")`` once ``hora.lightning`` is imported (Lightning
1.x spelled it ``accelerator='horovod'``). The strategy averages gradients
with hvd.DistributedOptimizer, scales the learning rate by the number of
workers, gives each worker its share of the data, checkpoints and logs on
rank 0, and averages the logged metrics (``sync_dist=True``) across workers.
Every rank prints a checksum of its final weights: they must be equal. The
data ships inside scikit-learn, so nothing is downloaded.
"""

import argparse
import hashlib

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import hora.lightning  # noqa: F401 - registers Trainer(strategy="horovod")

parser = argparse.ArgumentParser(description="hora Lightning digits example")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per worker")
parser.add_argument("--epochs", type=int, default=8, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one worker")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
parser.add_argument("--root-dir", default="lightning_digits",
                    help="where rank 0 writes checkpoints and logs")


class DigitsNet(pl.LightningModule):
    def __init__(self, lr, momentum):
        super().__init__()
        self.save_hyperparameters()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)

    def training_step(self, batch, batch_idx):
        data, target = batch
        loss = F.nll_loss(self(data), target)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch, batch_idx):
        data, target = batch
        output = self(data)
        self.log("test_loss", F.nll_loss(output, target), sync_dist=True)
        self.log("test_acc", output.argmax(dim=1).eq(target).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        # The strategy multiplies lr by the number of workers (scale_lr=True).
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr,
                               momentum=self.hparams.momentum)


def datasets(seed):
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    # The same permutation on every rank: the split must not differ between workers.
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    images, labels = images[order], labels[order]
    cut = int(0.8 * len(labels))
    return (TensorDataset(images[:cut], labels[:cut]),
            TensorDataset(images[cut:], labels[cut:]))


def weight_checksum(model):
    flat = torch.cat([p.detach().double().flatten().cpu() for p in model.parameters()])
    return f"{flat.sum().item():.12f} sha256:{hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]}"


def main():
    args = parser.parse_args()
    torch.set_num_threads(1)
    # The same seed on every rank: Lightning's DistributedSampler shuffles with it, and
    # the ranks' shares must come from one permutation. (The strategy broadcasts rank 0's
    # initial weights anyway.)
    pl.seed_everything(args.seed, verbose=False)
    train, test = datasets(args.seed)
    # Lightning gives each worker its share through a DistributedSampler.
    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test, batch_size=256)

    model = DigitsNet(args.lr, args.momentum)
    trainer = pl.Trainer(strategy="horovod", max_epochs=args.epochs,
                         accumulate_grad_batches=args.accumulate,
                         default_root_dir=args.root_dir, enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=10)
    trainer.fit(model, train_loader)
    results = trainer.test(model, test_loader, verbose=False)[0]
    if trainer.is_global_zero:
        print(f"Test set: Average loss: {results['test_loss']:.4f}, "
              f"Accuracy: {results['test_acc']:.4f}")
    print(f"rank {trainer.global_rank} of {trainer.world_size}: weight checksum "
          f"{weight_checksum(model)}")


if __name__ == "__main__":
    main()
