"""Small cached allreduces that ride the agreement round's exchange (the control mesh).

Ranks enqueue in different orders, so rounds see different ready sets and
payload layouts; every result must match the single-process reference, be
bit-identical on every rank, and equal what the Gloo path computes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scenarios import DTYPES, OPS, make_input
from scenarios_cache import average_inputs
from test_collectives import assert_close, reduce_ref

from tests.support.workers import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

SCENARIOS = Path(__file__).with_name("scenarios_cache.py")
STEPS = 4


def expected(key, size: int, step: int) -> torch.Tensor:
    dname, op, scaled = key
    dtype = DTYPES[dname]
    inputs = [make_input(r, dtype, (5, 3), salt=step) for r in range(size)]
    if not scaled:
        return reduce_ref(inputs, op)
    total = sum(0.5 * t.to(torch.float64) for t in inputs) * 2.0
    return total / size if op == "Average" else total


# Payloads through shared memory (the default on one machine), over the mesh's
# sockets, or not at all (Gloo). "pairwise": payloads too small for any tensor,
# so 2 or 4 ranks without shared memory (as on several machines) allreduce every
# batch by swaps between pairs of ranks (PairwiseAllreduce) instead of Gloo;
# 3 ranks use Gloo.
TRANSPORTS = {
    "shared-memory": {},
    "sockets": {"HORA_SHM_ALLREDUCE_BYTES": "0"},
    "gloo": {"HORA_SHM_ALLREDUCE_BYTES": "0", "HORA_MESH_ALLREDUCE_BYTES": "0"},
    "pairwise": {"HORA_SHM_ALLREDUCE_BYTES": "0", "HORA_MESH_ALLREDUCE_BYTES": "8"},
}


@pytest.mark.parametrize(("size", "transport"), [
    (3, "shared-memory"), (2, "shared-memory"), (3, "sockets"), (2, "sockets"), (3, "gloo"),
    (2, "pairwise"), (4, "pairwise"), (3, "pairwise")])
def test_every_dtype_and_op_matches_the_reference_on_every_rank(shared_coordinator, size,
                                                                transport):
    results = [r.value for r in run_workers(shared_coordinator, size, SCENARIOS, "mesh_steps",
                                            (list(DTYPES), OPS, STEPS),
                                            env=TRANSPORTS[transport])]
    for rank, (steps, mesh_batches, pairwise) in enumerate(results):
        if transport in ("gloo", "pairwise"):
            assert mesh_batches == 0, "the mesh's rounds carried data although too small"
        else:
            assert mesh_batches > 0, f"rank {rank}: no round carried its data"
        if transport == "pairwise" and size in (2, 4):
            assert pairwise > 0, f"rank {rank}: no batch went through the pairwise allreduce"
        elif transport in ("gloo", "shared-memory") or size == 3:
            assert pairwise == 0, f"rank {rank}: the pairwise allreduce ran unexpectedly"
        for step, outputs in enumerate(steps):
            for key, actual in outputs.items():
                try:
                    assert_close(actual, expected(key, size, step), DTYPES[key[0]])
                except AssertionError as exc:
                    raise AssertionError(f"rank {rank} step {step} {key}: {exc}") from exc
                assert torch.equal(actual, results[0][0][step][key]), (rank, step, key)


@pytest.mark.parametrize("transport", ["shared-memory", "sockets"])
def test_tensors_between_agreed_ones_in_a_payload_are_skipped(shared_coordinator, transport):
    results = [r.value for r in run_workers(shared_coordinator, 2, SCENARIOS, "mesh_gaps",
                                            (STEPS,), env=TRANSPORTS[transport])]
    for step in range(STEPS):
        for i in range(6):
            want = sum(make_input(r, torch.float32, (7,), salt=step + i) for r in range(2))
            for rank, steps in enumerate(results):
                torch.testing.assert_close(steps[step][i], want, msg=f"rank {rank} {step} {i}")


@pytest.mark.parametrize(("size", "transport"), [(2, "shared-memory"), (3, "shared-memory"),
                                                 (2, "sockets")])
def test_averages_carried_by_the_round_have_the_bits_of_a_sum_then_a_division(
        shared_coordinator, size, transport):
    """An average the payloads carry is divided as each rank packs it, where the
    set's size is a power of 2 (float32 and float64): the bits must be those of
    the sum in rank order, then the division (Horovod's), round after round."""
    dtypes = ["float32", "float64", "float16", "bfloat16"]
    results = [r.value for r in run_workers(shared_coordinator, size, SCENARIOS, "average_bits",
                                            (dtypes, STEPS), env=TRANSPORTS[transport])]
    for rank, (steps, mesh_batches) in enumerate(results):
        assert mesh_batches > 0, f"rank {rank}: no round carried its data"
        for step in range(1, STEPS):  # (the first goes through the coordinator and Gloo)
            for dname in dtypes:
                inputs = [average_inputs(r, step, dname) for r in range(size)]
                total = inputs[0].clone()
                for theirs in inputs[1:]:
                    total = total + theirs
                want = total.mul_(1.0 / size)
                got_one, got_run = steps[step][(dname, "one")], steps[step][(dname, "run")]
                assert torch.equal(got_one, want), (rank, step, dname)
                assert torch.equal(got_run, want[:300]), (rank, step, dname)
