"""The response cache, fusion, the mesh and the timeline, run inside worker processes
(see tests/support/workers.py); inputs come from scenarios.make_input."""

from __future__ import annotations

import os
import sys
import time

import torch

import hora.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scenarios import DTYPES, make_input  # noqa: E402 - beside this file

# -- response cache ------------------------------------------------------------------


def _negotiation_messages(http_url: str, job_id: str) -> int:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{http_url}/api/v1/jobs/{job_id}", timeout=10) as reply:
        return json.load(reply)["negotiation_messages"]


def steady_state_messages(http_url: str, job_id: str, steps: int):
    """Coordinator messages during `steps` training steps after warm-up."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.randn(4, 8)

    def step():
        opt.zero_grad()
        model(data).pow(2).mean().backward()
        opt.step()

    def step_with_metric():
        step()
        hvd.allreduce(torch.tensor(1.0), name="metric.loss")  # a metric, every step

    for _ in range(3):
        step_with_metric()
    hvd.barrier()
    before = _negotiation_messages(http_url, job_id)
    for _ in range(steps):
        step_with_metric()
    hvd.barrier()
    after = _negotiation_messages(http_url, job_id)
    # A cached allreduce (no coordinator message) holds the other ranks until
    # rank 0 has read the counter: their next barrier must not race the read.
    hvd.allreduce(torch.tensor(1.0), name="metric.loss")
    hvd.barrier()
    idle = _negotiation_messages(http_url, job_id)
    # (after - before) is the steps plus one barrier; (idle - after) is one barrier.
    return before, after, idle


def cache_invalidation():
    rank = hvd.rank()
    out = {}
    for i in range(3):
        out[f"same.{i}"] = hvd.allreduce(torch.ones(4), name="x", op=hvd.Sum)
    # Every rank changes the shape of a cached name: renegotiated, still right.
    out["grown"] = hvd.allreduce(torch.ones(6), name="x", op=hvd.Sum)
    out["grown.again"] = hvd.allreduce(torch.ones(6), name="x", op=hvd.Sum)
    # Only rank 0 changes the dtype of a cached name: a mismatch error, not a hang.
    x = torch.ones(6, dtype=torch.float64 if rank == 0 else torch.float32)
    try:
        hvd.allreduce(x, name="x", op=hvd.Sum)
    except hvd.HorovodInternalError as exc:
        out["mismatch"] = (type(exc).__name__, str(exc))
    out["after"] = hvd.allreduce(torch.ones(2), name="x", op=hvd.Sum)
    return out


def fusion_mix(rounds: int = 3):
    """Many async allreduces of mixed dtypes and sizes, some above the fusion threshold."""
    rank = hvd.rank()
    specs = [(torch.float32, 10), (torch.float64, 7), (torch.float32, 3000), (torch.int64, 5),
             (torch.float32, 1), (torch.float16, 64), (torch.float64, 900), (torch.int32, 33)]
    results = []
    for _ in range(rounds):  # round 0 negotiates, later rounds come from the cache
        handles = []
        for i, (dtype, n) in enumerate(specs):
            x = make_input(rank, dtype, (n,), salt=i)
            handles.append(hvd.allreduce_async(x, name=f"fuse.{i}", op=hvd.Sum))
        results.append([hvd.synchronize(h) for h in handles])
    return results, [(str(d), n) for d, n in specs]


def mesh_steps(dtype_names, op_names, steps):
    """Cached allreduces enqueued in a different order on odd ranks, so that rounds
    see different ready sets; returns each step's results, the mesh's batch count and
    the pairwise allreduce's count."""
    from hora import _runtime

    rank = hvd.rank()
    keys = [(d, o, False) for d in dtype_names for o in op_names]
    keys += [(d, o, True) for d in dtype_names if DTYPES[d].is_floating_point
             for o in ("Sum", "Average")]
    order = keys if rank % 2 == 0 else keys[::-1]
    steps_out = []
    for step in range(steps):
        handles = {}
        for i, (dname, oname, scaled) in enumerate(order):
            x = make_input(rank, DTYPES[dname], (5, 3), salt=step)
            scale = {"prescale_factor": 0.5, "postscale_factor": 2.0} if scaled else {}
            handles[(dname, oname, scaled)] = hvd.allreduce_async(
                x, name=f"mesh.{dname}.{oname}.{scaled}", op=getattr(hvd, oname), **scale)
            if rank == 1 and i % 5 == 0:
                time.sleep(0.002)
        steps_out.append({key: hvd.synchronize(h) for key, h in handles.items()})
    engine = _runtime.current().engine
    return steps_out, engine.mesh_batches, engine.pairwise_allreduces


def mesh_gaps(steps):
    """Rank 1 submits every other tensor first, so rank 0's payload holds tensors the
    round does not agree on between ones it does."""
    rank = hvd.rank()
    out = []
    for step in range(steps):
        xs = [make_input(rank, torch.float32, (7,), salt=step + i) for i in range(6)]
        # Step 0 negotiates, giving the names cache slots in name order.
        gaps = rank == 1 and step > 0
        order = [0, 2, 4, 1, 3, 5] if gaps else list(range(6))
        handles = {}
        for i in order:
            handles[i] = hvd.allreduce_async(xs[i], name=f"gap.{i}", op=hvd.Sum)
            if gaps and i == 4:
                time.sleep(0.05)
        out.append([hvd.synchronize(handles[i]) for i in range(6)])
    return out


def timeline_run(path_at_start: str, path_later: str):
    rank = hvd.rank()
    for _ in range(3):
        handles = [hvd.allreduce_async(torch.ones(100) * rank, name=f"grad.{i}")
                   for i in range(4)]
        for h in handles:
            hvd.synchronize(h)
    # A group is fused by the coordinator every time: the fusion-buffer events.
    hvd.grouped_allreduce([torch.ones(5), torch.ones(7)], name="group")
    hvd.broadcast(torch.ones(3), root_rank=0, name="bcast")
    hvd.stop_timeline()
    hvd.start_timeline(path_later, mark_cycles=False)
    hvd.allreduce(torch.ones(2), name="later")
    hvd.stop_timeline()
    return True


def train_for(seconds: float):
    """A small DistributedOptimizer loop for a fixed time (used with --autotune)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.randn(32, 64)
    deadline = time.monotonic() + seconds
    steps = 0
    while True:
        opt.zero_grad()
        model(data).pow(2).mean().backward()
        opt.step()
        steps += 1
        # Every rank stops at the same step: rank 0's clock decides.
        if hvd.broadcast_object(time.monotonic() > deadline, root_rank=0, name=f"stop.{steps}"):
            break
    return steps


def average_inputs(rank: int, step: int, dname: str) -> torch.Tensor:
    """Random floats over 40 binary orders of magnitude (12 in float16, which
    has no more in its normal range): averages that round."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    orders = 6 if dname == "float16" else 20
    scale = torch.exp2(torch.randint(-orders, orders, (1000,), generator=g).to(torch.float64))
    return (torch.randn(1000, generator=g, dtype=torch.float64) * scale).to(DTYPES[dname])


def average_bits(dtype_names, steps):
    """Cached averages of :func:`average_inputs`, each float dtype as one tensor and as
    a fused run of three; returns each step's results and the mesh's batch count."""
    from hora import _runtime

    rank = hvd.rank()
    out = []
    for step in range(steps):
        results = {}
        for dname in dtype_names:
            x = average_inputs(rank, step, dname)
            results[(dname, "one")] = hvd.allreduce(x, name=f"bits.{dname}")
            handles = [hvd.allreduce_async(x[i * 100:(i + 1) * 100].clone(),
                                           name=f"bits.{dname}.{i}") for i in range(3)]
            results[(dname, "run")] = torch.cat([hvd.synchronize(h) for h in handles])
        out.append(results)
    return out, _runtime.current().engine.mesh_batches
