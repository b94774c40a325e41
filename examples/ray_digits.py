"""Train scikit-learn's digits on a Ray cluster with hora, as with Horovod's ``horovod.ray``.

    python examples/ray_digits.py --address HEAD:6379 --num-workers 2
    python examples/ray_digits.py --address HEAD:6379 --elastic --min-workers 1

First a ``RayExecutor`` (a fixed world of Ray actors); with ``--elastic`` an
``ElasticRayExecutor`` instead, whose world follows the cluster's nodes: a
node that dies leaves the survivors training from the last commit, a node
that joins takes part from the next commit. Without ``--address`` Ray starts
a local cluster. A Horovod script that says ``from horovod.ray import
RayExecutor`` runs the same way with ``python -m hora.horovod script.py``.

The last line is ``RESULT {json}``: each rank's accuracy and a digest of its
parameters (equal on every rank after data-parallel training).
"""

import argparse
import hashlib
import json
import os
import time

import ray
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from sklearn.datasets import load_digits

parser = argparse.ArgumentParser(description="hora on Ray: digits")
parser.add_argument("--address", default=None, help="Ray cluster address (default: local)")
parser.add_argument("--num-workers", type=int, default=2, help="ranks of the fixed run")
parser.add_argument("--cpus-per-worker", type=float, default=1, help="CPUs per rank")
parser.add_argument("--epochs", type=int, default=8, help="number of epochs")
parser.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--elastic", action="store_true", help="run ElasticRayExecutor instead")
parser.add_argument("--min-workers", type=int, default=1, help="elastic: fewest ranks")
parser.add_argument("--max-workers", type=int, default=4, help="elastic: most ranks")
parser.add_argument("--batches-per-commit", type=int, default=5, help="elastic: commit every N")
parser.add_argument("--batch-sleep", type=float, default=0.0,
                    help="seconds each step sleeps (to watch an elastic run change)")
parser.add_argument("--timeout", type=float, default=120, help="start() timeout, seconds")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def datasets(seed):
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    images, labels = images[order], labels[order]
    cut = int(0.8 * len(labels))
    return (torch.utils.data.TensorDataset(images[:cut], labels[:cut]),
            torch.utils.data.TensorDataset(images[cut:], labels[cut:]))


def finish(hvd, model, test_dataset):
    """Test accuracy (averaged over ranks) and a digest of this rank's parameters."""
    model.eval()
    with torch.no_grad():
        images, labels = test_dataset.tensors
        correct = (model(images).argmax(1) == labels).float().mean()
    accuracy = hvd.allreduce(correct, name="test.accuracy").item()
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().numpy().tobytes())
    return {"rank": hvd.rank(), "size": hvd.size(), "accuracy": accuracy,
            "params": digest.hexdigest()[:16], "host": os.environ.get("HOROVOD_HOSTNAME"),
            "pid": os.getpid()}


def train(args):
    """One rank of the fixed run: Horovod's usual steps."""
    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_dataset, test_dataset = datasets(args.seed)
    sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed)
    loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                         sampler=sampler)
    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        for data, target in loader:
            optimizer.zero_grad()
            F.nll_loss(model(data), target).backward()
            optimizer.step()
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1} done on {hvd.size()} ranks", flush=True)
    return finish(hvd, model, test_dataset)


def train_elastic(args):
    """One worker of the elastic run: state committed every few batches."""
    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_dataset, test_dataset = datasets(args.seed)
    sampler = hvd.elastic.ElasticSampler(train_dataset, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                         sampler=sampler)
    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    @hvd.elastic.run
    def loop(state):
        while state.epoch < args.epochs:
            state.model.train()
            for batch_idx, (data, target) in enumerate(loader):
                state.optimizer.zero_grad()
                F.nll_loss(state.model(data), target).backward()
                state.optimizer.step()
                state.train_sampler.record_batch(batch_idx, args.batch_size)
                if args.batch_sleep:
                    time.sleep(args.batch_sleep)
                if (batch_idx + 1) % args.batches_per_commit == 0:
                    state.commit()
                    if hvd.rank() == 0:
                        print(f"commit: epoch {state.epoch} batch {batch_idx} "
                              f"world {hvd.size()} at {time.time():.3f}", flush=True)
            state.epoch += 1
            state.train_sampler.set_epoch(state.epoch)
            state.commit()

    def rescale():
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0)
    state.register_reset_callbacks([rescale])
    loop(state)
    return finish(hvd, model, test_dataset)


def main():
    args = parser.parse_args()
    ray.init(address=args.address)
    from hora.ray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=args.timeout)
    began = time.monotonic()
    if args.elastic:
        from hora.ray import ElasticRayExecutor

        executor = ElasticRayExecutor(settings, min_workers=args.min_workers,
                                      max_workers=args.max_workers,
                                      cpus_per_slot=args.cpus_per_worker)
        executor.start()
        print(f"started in {time.monotonic() - began:.1f} s", flush=True)
        results = executor.run(lambda: train_elastic(args))
        executor.shutdown()
    else:
        executor = RayExecutor(settings, num_workers=args.num_workers,
                               cpus_per_worker=args.cpus_per_worker)
        executor.start()
        print(f"started in {time.monotonic() - began:.1f} s", flush=True)
        results = executor.run(train, args=[args])
        executor.shutdown()
    for result in results:
        print(f"rank {result['rank']} on {result['host']} (pid {result['pid']}): accuracy "
              f"{result['accuracy']:.4f}, parameters {result['params']}", flush=True)
    print(f"took {time.monotonic() - began:.1f} s", flush=True)
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
