"""Adasum and SyncBatchNorm over real ranks, against single-process references.

The Adasum reference is written here from the formula, independently of
hora.torch.adasum; the SyncBatchNorm reference is torch.nn.BatchNorm2d on the
concatenated global batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scenarios_numeric import (
    CHANNELS,
    DTYPES,
    adasum_input,
    global_batch,
    init_affine,
    loss_weights,
    offsets,
)

from tests.support.workers import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

SCENARIOS = Path(__file__).with_name("scenarios_numeric.py")


def values(results):
    return [r.value for r in results]


# -- Adasum -------------------------------------------------------------------


def reference_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.flatten().double(), b.flatten().double()
    dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    ca = 1.0 if aa == 0 else 1.0 - dot / (2.0 * aa)
    cb = 1.0 if bb == 0 else 1.0 - dot / (2.0 * bb)
    return ca * a + cb * b


def reference_adasum(inputs: list[torch.Tensor]) -> torch.Tensor:
    """Binary tree over rank order; an unpaired last element moves up a level as is."""
    level = [t.flatten().double() for t in inputs]
    while len(level) > 1:
        nxt = [reference_pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = nxt + level[len(nxt) * 2:]
    return level[0].reshape(inputs[0].shape)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_adasum_allreduce_matches_the_reference(shared_coordinator, size, dtype_name):
    shape = (3, 5)
    dtype = DTYPES[dtype_name]
    results = values(run_workers(shared_coordinator, size, SCENARIOS, "adasum_allreduce_ranks",
                                 (shape, dtype_name)))
    expected = reference_adasum([adasum_input(r, shape, dtype) for r in range(size)])
    for rank, outs in enumerate(results):
        for out in outs:
            assert out.dtype == dtype and out.shape == shape, f"rank {rank}"
            torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6,
                                       msg=lambda m, rank=rank: f"rank {rank}: {m}")
            assert torch.equal(out, results[0][0]), f"rank {rank} differs from rank 0"


# -- SyncBatchNorm --------------------------------------------------------------

TRAIN_STEPS = 2


def reference_batch_norm(total: int, dtype: torch.dtype, momentum: float | None) -> dict:
    bn = torch.nn.BatchNorm2d(CHANNELS, momentum=momentum).to(dtype)
    init_affine(bn)
    bn.train()
    steps = []
    for step in range(TRAIN_STEPS):
        x = global_batch(total, step, dtype).requires_grad_()
        out = bn(x)
        (out * loss_weights(total, step, dtype)).sum().backward()
        steps.append({"out": out.detach(), "grad_input": x.grad,
                      "grad_weight": bn.weight.grad.clone(), "grad_bias": bn.bias.grad.clone()})
        bn.zero_grad()
    bn.eval()
    with torch.no_grad():
        eval_out = bn(global_batch(total, TRAIN_STEPS, dtype))
    return {"steps": steps, "running_mean": bn.running_mean, "running_var": bn.running_var,
            "num_batches_tracked": int(bn.num_batches_tracked), "eval_out": eval_out}


@pytest.mark.parametrize(("counts", "dtype_name", "momentum"), [
    pytest.param([3, 5], "float64", 0.1, id="3+5-float64"),
    pytest.param([3, 5], "float32", 0.1, id="3+5-float32"),
    pytest.param([3, 5], "float64", None, id="3+5-float64-cumulative"),
    pytest.param([2, 1, 4], "float64", 0.1, id="2+1+4-float64"),
    pytest.param([6], "float64", 0.1, id="one-rank-is-plain-batch-norm"),
])
def test_sync_batch_norm_matches_batch_norm_on_the_global_batch(shared_coordinator, counts,
                                                                 dtype_name, momentum):
    dtype = DTYPES[dtype_name]
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else \
        {"rtol": 1e-10, "atol": 1e-10}
    results = values(run_workers(shared_coordinator, len(counts), SCENARIOS,
                                 "sync_batch_norm_steps",
                                 (counts, dtype_name, momentum, TRAIN_STEPS)))
    ref = reference_batch_norm(sum(counts), dtype, momentum)
    bounds = offsets(counts)

    def check(actual, expected, what):
        assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}"
        torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")

    for step in range(TRAIN_STEPS):
        expected = ref["steps"][step]
        for rank, result in enumerate(results):
            lo, hi = bounds[rank], bounds[rank + 1]
            got = result["steps"][step]
            check(got["out"], expected["out"][lo:hi], f"step {step} rank {rank} output")
            check(got["grad_input"], expected["grad_input"][lo:hi],
                  f"step {step} rank {rank} input grad")
        # Each rank holds its shard's part of the parameter gradients.
        for key in ("grad_weight", "grad_bias"):
            total = sum(r["steps"][step][key] for r in results)
            check(total, expected[key], f"step {step} {key} summed over ranks")
    for rank, result in enumerate(results):
        lo, hi = bounds[rank], bounds[rank + 1]
        check(result["running_mean"], ref["running_mean"], f"rank {rank} running_mean")
        check(result["running_var"], ref["running_var"], f"rank {rank} running_var")
        assert result["num_batches_tracked"] == ref["num_batches_tracked"] == TRAIN_STEPS
        check(result["eval_out"], ref["eval_out"][lo:hi], f"rank {rank} eval output")
