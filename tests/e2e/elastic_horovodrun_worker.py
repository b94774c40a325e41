"""A Horovod elastic training script, for the horovodrun-alike scenarios.

    elastic_horovodrun_worker.py LOGFILE [--epochs E] [--batches B]
                                 [--exit-at EPOCH START_RANK] [--hold EPOCH SIZE]

Written as a Horovod user writes one (``import horovod.torch as hvd``, the
start rank from ``HOROVOD_RANK``), after the script of Horovod's own elastic
integration tests: rank 0 appends one JSON line per epoch to LOGFILE (epoch,
size, start rank, host, rendezvous count, and every rank's start rank and
host in rank order), and the test's discovery script
reads how many lines there are to know which hosts to offer next.

``--exit-at E R``: the worker whose start rank is R raises at the first
batch of epoch E. ``--hold E N``: after epoch E every rank keeps committing
(each commit is a collective that notices host changes) until the world
has size N, so the next epoch runs in the world the test expects; after a
bounded number of tries it goes on, and the test's checks say what was
wrong.
"""

import argparse
import json
import os
import time

import horovod.torch as hvd
import torch

parser = argparse.ArgumentParser()
parser.add_argument("logfile")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batches", type=int, default=3)
parser.add_argument("--exit-at", type=int, nargs=2, action="append", default=[])
parser.add_argument("--hold", type=int, nargs=2, action="append", default=[])
args = parser.parse_args()

hostname = os.environ.get("HOROVOD_HOSTNAME")
start_rank = int(os.environ.get("HOROVOD_RANK", 0))
placement = {name: os.environ.get(f"HOROVOD_{name.upper()}") for name in
             ("size", "local_rank", "local_size", "cross_rank", "cross_size")}
exits = {epoch for epoch, rank in args.exit_at if rank == start_rank}
holds = dict(args.hold)

hvd.init()
torch.manual_seed(0)
data, target = torch.randn(8, 2), torch.randint(0, 2, (8,))
model = torch.nn.Linear(2, 2)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())


@hvd.elastic.run
def train(state):
    state.rendezvous += 1
    while state.epoch < args.epochs:
        while state.batch < args.batches:
            if state.batch == 0 and state.epoch in exits:
                raise RuntimeError(f"start rank {start_rank} fails at epoch {state.epoch}")
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(data), target).backward()
            optimizer.step()
            state.batch += 1
            state.commit()
        # Every rank's (start rank, host), by rank: hvd.rank() as the coordinator
        # numbered this generation.
        world = hvd.allgather_object([start_rank, hostname])
        if hvd.rank() == 0:
            line = {"epoch": state.epoch, "size": hvd.size(), "rank": hvd.rank(),
                    "start_rank": start_rank, "hostname": hostname,
                    "rendezvous": state.rendezvous, "placement": placement, "world": world}
            with open(args.logfile, "a") as f:
                f.write(json.dumps(line) + "\n")
        state.epoch += 1
        state.batch = 0
        state.commit()
        want = holds.get(state.epoch - 1)
        for _ in range(2400):  # counted, not timed: every rank commits as often
            if want is None or hvd.size() == want:
                break
            time.sleep(0.05)
            state.commit()


state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0, rendezvous=0)
train(state)
print(f"done start_rank {start_rank} rank {hvd.rank()} of {hvd.size()}", flush=True)
