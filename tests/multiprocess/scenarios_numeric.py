"""Numeric scenarios run inside worker processes: Adasum and SyncBatchNorm.

Every input comes from a helper seeded by (rank, step, ...), so the test
process can rebuild each rank's input, or the whole global batch, and compute
a single-process reference.
"""

from __future__ import annotations

import torch

import hora.torch as hvd
from hora.torch.adasum import adasum_allreduce
from hora.torch.sync_batch_norm import SyncBatchNorm

DTYPES = {"float32": torch.float32, "float64": torch.float64}
CHANNELS = 4
SPATIAL = (3, 3)


def adasum_input(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def adasum_allreduce_ranks(shape, dtype_name):
    """Every rank combines its own tensor with Adasum; returns the result."""
    x = adasum_input(hvd.rank(), tuple(shape), DTYPES[dtype_name])
    before = x.clone()
    out = adasum_allreduce(x, name=f"adasum.{dtype_name}")
    if not torch.equal(x, before):
        raise AssertionError("adasum_allreduce modified its input")
    # The same rule through the allreduce API users call: op=hvd.Adasum.
    via_allreduce = hvd.allreduce(x, name=f"adasum.op.{dtype_name}", op=hvd.Adasum)
    inplace = x.clone()
    hvd.synchronize(hvd.allreduce_async_(inplace, name=f"adasum.async.{dtype_name}",
                                         op=hvd.Adasum))
    return out, via_allreduce, inplace


# -- SyncBatchNorm -----------------------------------------------------------


def global_batch(total: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    """The whole batch of one step; rank r takes rows offsets[r]:offsets[r + 1]."""
    gen = torch.Generator().manual_seed(2000 + step)
    x = torch.randn((total, CHANNELS) + SPATIAL, generator=gen, dtype=torch.float64)
    # Per-channel shifts and scales, so that the statistics differ between channels.
    shift = torch.arange(CHANNELS, dtype=torch.float64).reshape(1, -1, 1, 1)
    return (x * (1 + shift) + 3 * shift - 2).to(dtype)


def loss_weights(total: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3000 + step)
    return torch.randn((total, CHANNELS) + SPATIAL, generator=gen, dtype=torch.float64).to(dtype)


def init_affine(module: torch.nn.Module) -> None:
    with torch.no_grad():
        module.weight.copy_(1 + 0.25 * torch.arange(CHANNELS))
        module.bias.copy_(0.5 * torch.arange(CHANNELS) - 0.75)


def offsets(counts: list[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def sync_batch_norm_steps(counts, dtype_name, momentum, train_steps):
    """Trains ``train_steps`` steps on this rank's shard, then runs one eval forward.

    Returns, per step, the output, the input's gradient and the local
    weight/bias gradients; then the running statistics and the eval output.
    """
    dtype = DTYPES[dtype_name]
    rank, total = hvd.rank(), sum(counts)
    lo, hi = offsets(counts)[rank], offsets(counts)[rank + 1]
    bn = SyncBatchNorm(CHANNELS, momentum=momentum).to(dtype)
    init_affine(bn)
    bn.train()
    steps = []
    for step in range(train_steps):
        x = global_batch(total, step, dtype)[lo:hi].clone().requires_grad_()
        out = bn(x)
        (out * loss_weights(total, step, dtype)[lo:hi]).sum().backward()
        steps.append({"out": out.detach(), "grad_input": x.grad,
                      "grad_weight": bn.weight.grad.clone(), "grad_bias": bn.bias.grad.clone()})
        bn.zero_grad()
    bn.eval()
    with torch.no_grad():
        eval_out = bn(global_batch(total, train_steps, dtype)[lo:hi])
    return {"steps": steps, "running_mean": bn.running_mean.clone(),
            "running_var": bn.running_var.clone(),
            "num_batches_tracked": int(bn.num_batches_tracked), "eval_out": eval_out}
