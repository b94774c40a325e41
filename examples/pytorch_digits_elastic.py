"""Elastic training on scikit-learn's digits, in the style of Horovod's elastic train.py.

    horarun -np 3 --min-np 2 --max-np 3 \
        --host-discovery-script ./discover_hosts.sh python examples/pytorch_digits_elastic.py

The training state (model, optimizer, epoch, batch and the sampler's record
of processed samples) is committed every few batches. When a worker dies,
the others restore the last commit, re-form the world without it and carry
on; when a worker is added, everyone re-forms the world at the next commit
and the newcomer receives the state by broadcast. The learning rate is
rescaled to the new world size by a reset callback.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from sklearn.datasets import load_digits

import hora.torch as hvd

parser = argparse.ArgumentParser(description="hora elastic digits example")
parser.add_argument("--batch-size", type=int, default=16, help="input batch size per worker")
parser.add_argument("--epochs", type=int, default=6, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one worker")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--batches-per-commit", type=int, default=5,
                    help="commit the state every N batches")
parser.add_argument("--seed", type=int, default=42, help="random seed")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x.flatten(1)))), dim=1)


def datasets(seed):
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(labels))
    train, test = order[:cut], order[cut:]
    return (torch.utils.data.TensorDataset(images[train], labels[train]),
            torch.utils.data.TensorDataset(images[test], labels[test]))


def main():
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset, test_dataset = datasets(args.seed)
    # Elastic: the sampler re-partitions what is left of the epoch when the world changes.
    train_sampler = hvd.elastic.ElasticSampler(train_dataset, shuffle=True, seed=args.seed)
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler)

    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    @hvd.elastic.run
    def train(state):
        while state.epoch < args.epochs:
            state.model.train()
            # After a reset the loader iterates only what is left of the epoch.
            for batch_idx, (data, target) in enumerate(train_loader):
                state.batch = batch_idx
                state.optimizer.zero_grad()
                loss = F.nll_loss(state.model(data), target)
                loss.backward()
                state.optimizer.step()
                # Record the samples this step consumed, so a reset never repeats them.
                state.train_sampler.record_batch(batch_idx, args.batch_size)
                if (batch_idx + 1) % args.batches_per_commit == 0:
                    if hvd.rank() == 0:
                        print(f"Train Epoch: {state.epoch} batch {batch_idx} "
                              f"world {hvd.size()}\tLoss: {loss.item():.4f}", flush=True)
                    state.commit()
            end_epoch(state)

    def end_epoch(state):
        state.epoch += 1
        state.batch = 0
        state.train_sampler.set_epoch(state.epoch)
        state.commit()

    def on_state_reset():
        # The world changed size: rescale the learning rate.
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, train_sampler=train_sampler,
                                   epoch=0, batch=0)
    state.register_reset_callbacks([on_state_reset])
    train(state)

    model.eval()
    correct = torch.tensor(0.0)
    with torch.no_grad():
        images, labels = test_dataset.tensors
        correct = (model(images).argmax(1) == labels).float().mean()
    accuracy = hvd.allreduce(correct, name="test.accuracy").item()
    if hvd.rank() == 0:
        print(f"\nTest set: Accuracy: {accuracy:.4f} (world of {hvd.size()})", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
