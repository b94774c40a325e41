"""A small elastic job for the dashboard's browser tests.

    dashboard_job.py STOP_FILE SLOW_HOST NAP_S

Each rank trains a tiny model until STOP_FILE exists (or 150 s have passed).
The worker on host SLOW_HOST sleeps NAP_S seconds in every step, so it is
the straggler whatever rank it holds after a reset. The batch size is
reported, so the dashboard shows samples per second. Whether to stop is
agreed by every rank (an allreduce of the flag), so they all stop at the
same step and the job ends cleanly.
"""

import os
import socket
import sys
import time
from pathlib import Path

import torch

import hora.torch as hvd

stop_file, slow_host, nap = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
host = os.environ.get("HORA_HOSTNAME", socket.gethostname())
BATCH = 32

hvd.init()
hvd.set_batch_size(BATCH)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())
x = torch.randn(BATCH, 8)
y = x.sum(dim=1, keepdim=True)
deadline = time.monotonic() + 150


@hvd.elastic.run
def train(state):
    while True:
        if host == slow_host:
            time.sleep(nap)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        state.steps += 1
        if state.steps % 10 == 0:
            state.commit()
        done = stop_file.exists() or time.monotonic() > deadline
        flag = torch.tensor([1.0 if done else 0.0])
        if hvd.allreduce(flag, name="stop", op=hvd.Max).item() > 0:
            return
        time.sleep(0.01)


state = hvd.elastic.TorchState(model, optimizer, steps=0)
train(state)
print(f"rank {hvd.rank()} of {hvd.size()} on {host} stops after {state.steps} steps", flush=True)
hvd.shutdown()
