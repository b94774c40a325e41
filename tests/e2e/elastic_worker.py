"""An elastic training worker for the elastic acceptance tests and the recovery benchmark.

    elastic_worker.py OUT_DIR [--epochs E] [--kill-rank R --kill-step S] [--fail-on-host H]
                      [--step-sleep SECONDS] [--hold-at-step S --hold-until-size N]

It trains a tiny model on a dataset of sample ids with TorchState and
ElasticSampler, commits after every step, and keeps in the committed state
the ids every rank applied (gathered each step). At the end each worker
writes a JSON report to OUT_DIR: its pid, the world sizes it saw, the
applied ids per epoch, and a digest of its final parameters.
"""

import argparse
import json
import os
import socket
import sys
import time

import torch

import hora.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("--samples", type=int, default=240)
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--kill-rank", type=int, default=-1)
parser.add_argument("--kill-step", type=int, default=-1)
parser.add_argument("--fail-on-host", default="")
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--progress-every", type=int, default=5)
# Pause at a step, committing, until the world has grown to a size (for tests
# that add a host: training must not end before the newcomer arrives).
parser.add_argument("--hold-at-step", type=int, default=-1)
parser.add_argument("--hold-until-size", type=int, default=0)
args = parser.parse_args()

host = os.environ.get("HORA_HOSTNAME", socket.gethostname())
if args.fail_on_host and host == args.fail_on_host:
    print(f"worker on {host}: failing on purpose", file=sys.stderr, flush=True)
    sys.exit(3)

hvd.init()
torch.manual_seed(0)
ids = torch.arange(args.samples)
dataset = torch.utils.data.TensorDataset(ids.float().unsqueeze(1) / args.samples, ids)
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=1)
loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
model = torch.nn.Linear(1, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())
step_times = []
kill_log = os.path.join(args.out_dir, "kill.json")


@hvd.elastic.run
def train(state):
    state.sizes.append(hvd.size())
    while state.epoch < args.epochs:
        for batch_idx, (x, batch_ids) in enumerate(loader):
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
            applied = hvd.allgather(batch_ids, name="applied.ids")
            state.applied[state.epoch].extend(applied.tolist())
            state.train_sampler.record_batch(batch_idx, args.batch_size)
            state.steps += 1
            step_times.append([time.time(), hvd.size()])
            if hvd.rank() == 0 and state.steps % args.progress_every == 0:
                with open(os.path.join(args.out_dir, "progress"), "w") as f:
                    f.write(f"{state.steps} {hvd.size()}\n")
            if hvd.rank() == args.kill_rank and state.steps == args.kill_step:
                with open(kill_log, "w") as f:
                    json.dump({"time": time.time(), "pid": os.getpid()}, f)
                os.kill(os.getpid(), 9)  # mid-epoch, after the step, before its commit
            state.commit()
            if state.steps == args.hold_at_step:
                # Counted, not timed: every rank commits (a collective) as
                # often as the others, until the reset that grows the world.
                for _ in range(1200):
                    if hvd.size() >= args.hold_until_size:
                        break
                    time.sleep(0.1)
                    state.commit()
            if args.step_sleep:
                time.sleep(args.step_sleep)
        state.epoch += 1
        state.train_sampler.set_epoch(state.epoch)
        state.commit()


state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0, steps=0,
                               applied=[[] for _ in range(args.epochs)], sizes=[])
start_pid = os.getpid()
train(state)

flat = torch.cat([p.detach().flatten() for p in model.parameters()])
everyone = hvd.allgather(flat.unsqueeze(0), name="final.params")
report = {
    "pid": os.getpid(), "start_pid": start_pid, "host": host, "rank": hvd.rank(),
    "size": hvd.size(), "sizes": state.sizes, "applied": state.applied,
    "params": flat.tolist(), "params_identical": bool((everyone == everyone[0]).all()),
    "step_times": step_times,
}
with open(os.path.join(args.out_dir, f"report.{os.getpid()}.json"), "w") as f:
    json.dump(report, f)
print(f"done rank {hvd.rank()} of {hvd.size()} pid {os.getpid()}", flush=True)
hvd.shutdown()
