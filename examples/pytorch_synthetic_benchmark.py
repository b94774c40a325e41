"""Synthetic-data training throughput, the way Horovod users measure it.

    horarun -np 2 python examples/pytorch_synthetic_benchmark.py --model cnn

Trains on random data (no input pipeline), times batches of iterations and
prints images/sec per worker and in total, as Horovod's synthetic benchmark
does. The models are small so that the benchmark runs on a CPU.
"""

import argparse
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import hora.torch as hvd

parser = argparse.ArgumentParser(description="hora synthetic benchmark")
parser.add_argument("--model", default="cnn", choices=["cnn", "mlp"], help="model to train")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per worker")
parser.add_argument("--num-warmup-batches", type=int, default=3, help="warm-up batches")
parser.add_argument("--num-batches-per-iter", type=int, default=5, help="batches per iteration")
parser.add_argument("--num-iters", type=int, default=5, help="timed iterations")
parser.add_argument("--fp16-allreduce", action="store_true", help="fp16 gradient compression")
parser.add_argument("--use-adasum", action="store_true", help="Adasum instead of averaging")


class ConvNet(nn.Module):
    """About 1.2M parameters on 3x64x64 images."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 16 * 16, 72)
        self.fc2 = nn.Linear(72, 1000)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def build(name):
    if name == "cnn":
        return ConvNet(), (3, 64, 64)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 1024), nn.ReLU(),
                          nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1000))
    return model, (3, 32, 32)


def main():
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(42)

    model, shape = build(args.model)
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, *shape)
    target = torch.randint(0, 1000, (args.batch_size,))

    def benchmark_step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of workers: {hvd.size()}")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    img_secs = []
    for x in range(args.num_iters):
        elapsed = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / elapsed
        log(f"Iter #{x}: {img_sec:.1f} img/sec per worker")
        img_secs.append(img_sec)
    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per worker: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} worker(s): {hvd.size() * mean:.1f} "
        f"+-{hvd.size() * conf:.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
