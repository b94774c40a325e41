"""An elastic worker whose peer dies while gradients are in flight.

    elastic_optimizer_worker.py OUT_DIR --kill-at {in_forward,in_backward,after_step,in_commit}
                                --kill-step K
                                [--steps N] [--commit-every C] [--hidden H]

A small MLP trained with ``DistributedOptimizer`` and ``TorchState`` in the
Horovod loop ``zero_grad(); backward(); step()``, committing every C steps.
Step ``s`` consumes global batch ``s`` (GLOBAL_BATCH samples drawn from a
generator seeded with ``s``), split evenly between the ranks, so the
averaged gradient of a step does not depend on the world size and a single
process can replay the whole run (see :func:`replay`).

Rank 2 of the first (3-rank) world dies by SIGKILL at step K, at one of
the points of a training step:

- ``in_forward``: inside step K's forward pass, before any of its gradients
  exist, while the others are already in step K's backward allreduces;
- ``in_backward``: inside step K's ``backward()``, from a layer's backward
  that runs after the last layer's gradients were handed to allreduce;
- ``after_step``: right after ``optimizer.step()`` of step K-1, while the
  other ranks are already in step K's backward allreduces;
- ``in_commit``: inside ``state.commit()`` at step K (a commit step), after
  its state was saved and before the host-update check that every rank joins.

Every worker writes ``started.<pid>`` when it starts and, when it finishes,
``report.<pid>.json``: the worlds its training function was entered in, the
phase in which each failure reached it, the committed list of applied
``[step, world size]`` and the bytes of its final parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time

import torch

import hora.torch as hvd
from hora import _runtime

GLOBAL_BATCH = 12  # divisible by 3 and by 2: equal shards in either world
VICTIM_RANK = 2


class _KillSwitch(torch.autograd.Function):
    """Identity forward; its backward kills this process when armed."""

    armed = False
    armed_forward = False
    log_path = ""

    @staticmethod
    def forward(ctx, x):
        if _KillSwitch.armed_forward:
            _die(_KillSwitch.log_path, "in_forward")
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _KillSwitch.armed:
            _die(_KillSwitch.log_path, "in_backward")
        return grad


class Net(torch.nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.first = torch.nn.Linear(4, hidden)
        self.last = torch.nn.Linear(hidden, 1)

    def forward(self, x):
        return self.last(torch.tanh(_KillSwitch.apply(self.first(x))))


def make_model(hidden: int = 8) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net(hidden)
    # A wide hidden layer diverges at the narrow one's step size.
    lr = 0.05 if hidden <= 8 else 0.002
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 4, generator=gen)
    return x, x.sum(1, keepdim=True).sin()


def loss_of(model: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def replay(steps: list[int], hidden: int = 8) -> torch.Tensor:
    """The flat final parameters of one process applying ``steps`` on full batches."""
    model, opt = make_model(hidden)
    for step in steps:
        opt.zero_grad()
        loss_of(model, *batch(step)).backward()
        opt.step()
    return flat_params(model)


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _die(log_path: str, where: str) -> None:
    with open(log_path, "w") as f:
        json.dump({"pid": os.getpid(), "where": where}, f)
    # Give the allreduces already handed over a moment to reach the peers.
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--kill-at", required=True,
                        choices=["in_forward", "in_backward", "after_step", "in_commit"])
    parser.add_argument("--kill-step", type=int, required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--commit-every", type=int, default=4)
    # 4096: gradients of 98 KB, which the optimizer keeps in /dev/shm for its
    # peers to read in place (hora_native/mesh_resident.py).
    parser.add_argument("--hidden", type=int, default=8)
    args = parser.parse_args()
    out = args.out_dir
    start_pid = os.getpid()
    with open(os.path.join(out, f"started.{start_pid}"), "w") as f:
        f.write(os.environ.get("HORA_HOSTNAME", socket.gethostname()))
    _KillSwitch.log_path = os.path.join(out, "kill.json")

    hvd.init()
    model, opt = make_model(args.hidden)
    optimizer = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    worlds: list[dict] = []
    failures: list[dict] = []
    phase = ["start"]

    @hvd.elastic.run
    def train(state):
        worlds.append({"size": hvd.size(), "rank": hvd.rank(), "from_step": state.step})
        # Only a process that was rank 2 of the first, 3-rank world dies.
        victim = len(worlds) == 1 and hvd.size() == 3 and hvd.rank() == VICTIM_RANK
        try:
            while state.step < args.steps:
                size, rank = hvd.size(), hvd.rank()
                x, y = batch(state.step)
                per = GLOBAL_BATCH // size
                mine = slice(rank * per, (rank + 1) * per)
                at_kill_step = victim and state.step == args.kill_step
                _KillSwitch.armed = at_kill_step and args.kill_at == "in_backward"
                _KillSwitch.armed_forward = at_kill_step and args.kill_at == "in_forward"
                phase[0] = "zero_grad"
                optimizer.zero_grad()
                phase[0] = "backward"
                loss_of(model, x[mine], y[mine]).backward()
                phase[0] = "step"
                optimizer.step()
                state.applied.append([state.step, size])
                state.step += 1
                if victim and args.kill_at == "after_step" and state.step == args.kill_step:
                    _die(_KillSwitch.log_path, "after_step")
                if state.step % args.commit_every == 0:
                    phase[0] = "commit"
                    state.commit()
            worlds[-1]["resident"] = _runtime._runtime.engine.resident_payloads
        except BaseException as exc:
            worlds[-1]["resident"] = _runtime._runtime.engine.resident_payloads
            failures.append({"phase": phase[0], "error": type(exc).__name__,
                             "step": state.step, "size": hvd.size()})
            raise

    state = hvd.elastic.TorchState(model, optimizer, step=0, applied=[])
    if args.kill_at == "in_commit":
        save = state.save

        def save_then_die() -> None:
            save()
            if len(worlds) == 1 and hvd.size() == 3 and hvd.rank() == VICTIM_RANK \
                    and state.step == args.kill_step:
                _die(_KillSwitch.log_path, "in_commit")

        state.save = save_then_die
    train(state)

    flat = flat_params(model)
    report = {
        "pid": os.getpid(), "start_pid": start_pid, "rank": hvd.rank(), "size": hvd.size(),
        "worlds": worlds, "failures": failures, "step": state.step, "applied": state.applied,
        "params": flat.tolist(), "params_hex": flat.numpy().tobytes().hex(),
    }
    with open(os.path.join(out, f"report.{os.getpid()}.json"), "w") as f:
        json.dump(report, f)
    print(f"done rank {hvd.rank()} of {hvd.size()} pid {os.getpid()}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
