"""DistributedOptimizer options, each against single-process training on the whole batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.workers import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

SCENARIOS = Path(__file__).with_name("scenarios_optimizer.py")
import scenarios_optimizer as scenarios  # noqa: E402  (the test dir is on sys.path)


def reference(size: int, sparse: bool, steps: int = 3, fc_dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = scenarios.EmbeddingNet(sparse=sparse, fc_dtype=fc_dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    idx, target = scenarios.variant_batches(size, steps)
    for step in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(idx[step]), target[step]).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("variant,tol", [
    ("groups", 1e-6), ("explicit_groups", 1e-6), ("bf16", 2e-2), ("sparse", 1e-6),
    ("sparse_as_dense", 1e-6), ("skip_synchronize", 1e-6), ("predivide", 1e-6),
    ("mixed_groups", 1e-6),
])
def test_optimizer_variant_matches_single_process(shared_coordinator, variant, tol):
    results = [r.value for r in run_workers(shared_coordinator, 2, SCENARIOS, "train_variant",
                                            (variant,))]
    expected = reference(2, sparse=variant.startswith("sparse"),
                         fc_dtype=torch.float64 if variant == "mixed_groups" else torch.float32)
    for key, value in expected.items():
        assert torch.equal(results[0][key], results[1][key]), key
        torch.testing.assert_close(results[0][key], value, rtol=tol, atol=tol)


def test_optimizer_misuse_gets_clear_errors(shared_coordinator):
    for r in run_workers(shared_coordinator, 2, SCENARIOS, "optimizer_misuse"):
        assert "zero_grad() was called after loss.backward()" in r.value["zero_grad"]
        assert "still outstanding" in r.value["skip"]
        assert "duplicate names: ['w']" in r.value["dupes"]


def test_backward_after_shutdown_raises_at_the_first_hook(shared_coordinator):
    for r in run_workers(shared_coordinator, 2, SCENARIOS, "backward_after_shutdown"):
        assert r.value is not None and "NotInitializedError" in r.value, r.value


def _adasum_pair(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    dot = float(a @ b)
    return (1 - dot / (2 * float(a @ a))) * a + (1 - dot / (2 * float(b @ b))) * b


def test_adasum_optimizer_combines_each_ranks_update(shared_coordinator):
    results = [r.value for r in run_workers(shared_coordinator, 2, SCENARIOS,
                                            "adasum_optimizer_step")]
    (start, grads0, final0), (_, grads1, final1) = results
    for key in start:
        delta0, delta1 = -0.1 * grads0[key], -0.1 * grads1[key]
        expected = start[key].double().flatten() + _adasum_pair(delta0, delta1)
        torch.testing.assert_close(final0[key].double().flatten(), expected, rtol=1e-5,
                                   atol=1e-6)
        assert torch.equal(final0[key], final1[key])


def test_gradient_hooks_hand_small_gradients_over_in_batches(shared_coordinator):
    for r in run_workers(shared_coordinator, 2, SCENARIOS, "handover_batches"):
        out = r.value
        assert (out["small_in_flight"], out["small_noted"]) == (0, 1), out
        assert torch.equal(out["small_grad"], torch.full((4, 4), 1.5)), out["small_grad"]
        assert out["again"].startswith("GradientComputedAgainError: "), out
        assert "was computed again before step()" in out["again"], out
        assert (out["big_in_flight"], out["big_noted"]) == (1, 0), out


def test_noted_gradients_go_to_the_engine_in_one_call(shared_coordinator):
    for r in run_workers(shared_coordinator, 2, SCENARIOS, "handover_one_call"):
        out = r.value
        assert out["pending"] == [8], out  # 8 gradients, one call, one wait
        assert out["equal"] == [True] * 8, out
        assert "cannot reduce torch.complex64" in out["invalid"], out
        assert out["compressed"] == 3, out  # each of the 3 gradients once
        assert out["after"].tolist() == [2.0, 2.0], out
        assert "'one' is already in flight" in out["twice"], out
        assert out["in_flight"] == [], out
        assert out["batch"] == [[3.0, 3.0], [3.0, 3.0]], out
        if r.rank == 0:
            assert "'g.1' is already in flight" in out["group_clash"], out
            assert out["group_in_flight"] == ["g.1"], out
        assert out["group"] == [[2.0, 2.0], [2.0, 2.0]], out
