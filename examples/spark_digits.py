"""Train scikit-learn's digits on a Spark cluster with hora, as with Horovod's ``horovod.spark``.

    python examples/spark_digits.py                       # local-cluster[2,1,1024]
    python examples/spark_digits.py --master spark://HOST:7077 --num-proc 4
    python examples/spark_digits.py --elastic              # run_elastic instead

The driver reads the digits into a Spark DataFrame and ships its rows to the
ranks with the function (a small data set travels with the job); each rank
trains on its shard in one Spark barrier task. With ``--elastic`` the tasks
are elastic workers: an executor that is lost leaves the others training from
the last commit, and the task Spark starts again joins at the next one. A
Horovod script that says ``import horovod.spark`` runs the same way with
``python -m hora.horovod script.py``.

The last line is ``RESULT {json}``: each rank's accuracy and a digest of its
parameters (equal on every rank).
"""

import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from pyspark.sql import SparkSession
from sklearn.datasets import load_digits

parser = argparse.ArgumentParser(description="hora on Spark: digits")
parser.add_argument("--master", default="local-cluster[2,1,1024]", help="Spark master")
parser.add_argument("--num-proc", type=int, default=2, help="ranks (Spark tasks)")
parser.add_argument("--epochs", type=int, default=8, help="number of epochs")
parser.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--elastic", action="store_true", help="use hora.spark.run_elastic")
parser.add_argument("--min-num-proc", type=int, default=1, help="elastic: fewest ranks")
parser.add_argument("--batches-per-commit", type=int, default=5, help="elastic: commit every N")
parser.add_argument("--batch-sleep", type=float, default=0.0,
                    help="seconds each step sleeps (to watch an elastic run change)")
parser.add_argument("--progress", default=None,
                    help="elastic: a file rank 0 appends a line to at every commit")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def digits_frame(spark, seed):
    """The digits as a Spark DataFrame (64 pixel columns and a label), split 80/20."""
    digits = load_digits()
    rows = [(*map(float, image), int(label), i)
            for i, (image, label) in enumerate(zip(digits.data, digits.target, strict=True))]
    columns = [f"p{i}" for i in range(64)] + ["label", "id"]
    frame = spark.createDataFrame(rows, columns)
    return frame.randomSplit([0.8, 0.2], seed=seed)


def to_tensors(rows):
    images = torch.tensor([row[:64] for row in rows], dtype=torch.float32) / 16.0
    labels = torch.tensor([row[64] for row in rows], dtype=torch.int64)
    return images, labels


def result(hvd, model, test):
    images, labels = test
    model.eval()
    with torch.no_grad():
        correct = (model(images).argmax(1) == labels).float().mean()
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().numpy().tobytes())
    return {"rank": hvd.rank(), "size": hvd.size(),
            "accuracy": hvd.allreduce(correct, name="test.accuracy").item(),
            "params": digest.hexdigest()[:16], "pid": os.getpid()}


def train(train_rows, test_rows, args):
    """One rank: its shard of the shipped rows, Horovod's usual steps."""
    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    images, labels = to_tensors(train_rows[hvd.rank()::hvd.size()])
    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    generator = torch.Generator().manual_seed(args.seed)
    for _ in range(args.epochs):
        order = torch.randperm(len(labels), generator=generator)
        for start in range(0, len(order), args.batch_size):
            batch = order[start:start + args.batch_size]
            optimizer.zero_grad()
            F.nll_loss(model(images[batch]), labels[batch]).backward()
            optimizer.step()
    return result(hvd, model, to_tensors(test_rows))


def train_elastic(train_rows, test_rows, args):
    """One elastic worker: the rows re-sharded by the world of each generation."""
    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    images, labels = to_tensors(train_rows)
    dataset = torch.utils.data.TensorDataset(images, labels)
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
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
                    if hvd.rank() == 0 and args.progress:
                        with open(args.progress, "a") as out:
                            out.write(f"commit: epoch {state.epoch} batch {batch_idx} "
                                      f"world {hvd.size()} at {time.time():.3f}\n")
            state.epoch += 1
            state.train_sampler.set_epoch(state.epoch)
            state.commit()

    def rescale():
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0)
    state.register_reset_callbacks([rescale])
    loop(state)
    return result(hvd, model, to_tensors(test_rows))


def main():
    args = parser.parse_args()
    import hora.spark

    # The executors' Python: this one (with torch and hora), not the first python3 on
    # the PATH; read when the session starts its JVM.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    began = time.monotonic()
    spark = (SparkSession.builder.master(args.master).appName("hora-spark-digits")
             .config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .getOrCreate())
    print(f"Spark session up in {time.monotonic() - began:.1f} s", flush=True)
    train_frame, test_frame = digits_frame(spark, args.seed)
    train_rows = [tuple(row) for row in train_frame.orderBy("id").collect()]
    test_rows = [tuple(row) for row in test_frame.collect()]
    began = time.monotonic()
    if args.elastic:
        results = hora.spark.run_elastic(train_elastic, args=(train_rows, test_rows, args),
                                         num_proc=args.num_proc,
                                         min_num_proc=args.min_num_proc,
                                         max_num_proc=args.num_proc, elastic_timeout=120)
    else:
        results = hora.spark.run(train, args=(train_rows, test_rows, args),
                                 num_proc=args.num_proc)
    for item in results:
        print(f"rank {item['rank']} (pid {item['pid']}): accuracy {item['accuracy']:.4f}, "
              f"parameters {item['params']}", flush=True)
    print(f"training took {time.monotonic() - began:.1f} s", flush=True)
    spark.stop()
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
