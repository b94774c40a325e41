"""DistributedOptimizer and broadcast_optimizer_state behave as Horovod's (issue 9, item 5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.workers import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

SCENARIOS = Path(__file__).with_name("scenarios_optimizer_state.py")


def test_broadcast_optimizer_state_with_parameters_without_gradients(shared_coordinator):
    results = [r.value for r in run_workers(shared_coordinator, 2, SCENARIOS,
                                            "state_without_gradients")]
    for out in results:
        # Horovod's test_broadcast_state_no_grad: the trainable parameter got a
        # zero gradient while the state was made, the frozen one none.
        assert torch.equal(out["grad"], torch.zeros(4))
        assert torch.equal(out["grad"], out["grad_broadcast"])
        assert out["frozen_grad_is_none"]
        assert out["state_keys"] == [1]
        assert out["mixed_lr"] == pytest.approx(0.1) and out["mixed_lr_type"] == "float"
        assert out["mixed_emb_grad_sparse"] and out["mixed_frozen_grad_is_none"]
        assert out["mixed_state"] == {0: ["momentum_buffer"], 1: ["momentum_buffer"],
                                      2: ["momentum_buffer"]}
    assert torch.equal(results[0]["b"], results[1]["b"])


def test_parameter_names_without_named_parameters_follow_horovod(shared_coordinator):
    results = [r.value for r in run_workers(shared_coordinator, 2, SCENARIOS,
                                            "parameter_names_without_named_parameters")]
    expected = ["allreduce.noname.0.0", "allreduce.noname.0.1",
                "allreduce.noname.1.0", "allreduce.noname.1.1"]
    assert results[0][0] == results[1][0] == expected
    for key, value in results[0][1].items():
        assert torch.equal(value, results[1][1][key]), key


@pytest.mark.parametrize("groups", [None, 1])
def test_sparse_adam_gets_sparse_gradients(shared_coordinator, groups):
    results = [r.value for r in run_workers(shared_coordinator, 2, SCENARIOS, "sparse_adam",
                                            (groups,))]
    for kinds, _, _ in results:
        assert kinds == [[True, True]] * 3
    (_, first0, second0), (_, first1, second1) = results
    assert torch.equal(first0, first1) and torch.equal(second0, second1)
    # Rows used by either rank moved; the others did not.
    torch.manual_seed(0)
    start = torch.nn.Embedding(10, 3, sparse=True).weight.detach()
    moved = sorted(int(i) for i in (first0 != start).any(1).nonzero())
    assert moved == [0, 1, 2, 5]


def test_step_after_synchronize_warns_in_horovods_words(shared_coordinator):
    results = [r.value for r in run_workers(shared_coordinator, 2, SCENARIOS,
                                            "step_after_synchronize_warns")]
    for out in results:
        assert len(out[False]) == 1
        assert "optimizer.step() called without optimizer.skip_synchronize()" in out[False][0]
        assert out[True] == []
    assert torch.equal(results[0]["weight"], results[1]["weight"])
