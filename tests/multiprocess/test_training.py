"""Training helpers over real workers: DistributedOptimizer, broadcasts, objects.

Data-parallel SGD with averaged gradients over equal shards is the same as
single-process SGD on the whole batch, so the reference is a plain torch
loop in this process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.workers import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

SCENARIOS = Path(__file__).with_name("scenarios.py")
SCENARIOS_OPTIMIZER = SCENARIOS.with_name("scenarios_optimizer.py")


def reference_training(size: int, backward_passes: int, steps: int, opt_name: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    # The workers call broadcast_optimizer_state on the new optimizer, which
    # (as Horovod's does) makes its state with one step on zero gradients.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    gen = torch.Generator().manual_seed(1234)
    data = torch.randn(steps, backward_passes, 4 * size, 6, generator=gen)
    target = torch.randint(0, 3, (steps, backward_passes, 4 * size), generator=gen)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(backward_passes):
            torch.nn.functional.cross_entropy(model(data[step, micro]),
                                              target[step, micro]).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("compression,backward_passes,opt_name,tol", [
    ("none", 1, "sgd", 1e-5),
    ("none", 2, "adam", 1e-5),
    ("fp16", 2, "sgd", 5e-3),
])
def test_distributed_optimizer_matches_single_process(shared_coordinator, size, compression,
                                                       backward_passes, opt_name, tol):
    steps = 4
    results = [r.value for r in run_workers(
        shared_coordinator, size, SCENARIOS, "train_steps",
        (compression, backward_passes, steps, opt_name))]
    expected = reference_training(size, backward_passes, steps, opt_name)
    for rank, params in enumerate(results):
        for key, value in expected.items():
            # Every rank ends with the same parameters...
            torch.testing.assert_close(params[key], results[0][key], rtol=0, atol=0)
            # ...and they are those of single-process training on the whole batch.
            torch.testing.assert_close(params[key], value, rtol=tol, atol=tol,
                                       msg=lambda m, k=key, r=rank: f"rank {r} {k}: {m}")


@pytest.mark.parametrize("size", [2, 3])
def test_objects_parameters_and_optimizer_state(shared_coordinator, size):
    results = [r.value for r in run_workers(shared_coordinator, size, SCENARIOS,
                                            "objects_and_state")]
    root_obj = {"rank": 0, "payload": [0, 1, 2]}
    for result in results:
        assert result["bcast"] == root_obj
        assert result["gathered"] == [{"rank": r, "payload": list(range(r + 3))}
                                      for r in range(size)]
    for result in results[1:]:
        for key, value in results[0]["params"].items():
            assert torch.equal(result["params"][key], value), key
        for name in ("sgd", "adam"):
            mine, root = result["opt"][name], results[0]["opt"][name]
            assert mine["param_groups"] == root["param_groups"], name
            assert mine["state"].keys() == root["state"].keys()
            for idx, state in root["state"].items():
                for k, v in state.items():
                    other = mine["state"][idx][k]
                    if isinstance(v, torch.Tensor):
                        assert torch.equal(other, v), (name, idx, k)
                    else:
                        assert other == v, (name, idx, k)
    # Rank 0 used lr 0.1 / 0.01; the broadcast gave every rank rank 0's hyperparameters.
    assert results[-1]["opt"]["sgd"]["param_groups"][0]["lr"] == pytest.approx(0.1)
    assert results[-1]["opt"]["adam"]["param_groups"][0]["lr"] == pytest.approx(0.01)


def _assert_same(a, b, where):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_broadcast_optimizer_state_for_every_torch_optimizer(shared_coordinator):
    results = [r.value for r in run_workers(shared_coordinator, 2, SCENARIOS_OPTIMIZER,
                                            "every_optimizer_state")]
    names = [n for n in results[0] if n != "LBFGS"]
    assert {"SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Rprop", "SparseAdam"} <= set(names)
    for name in names:
        _assert_same(results[0][name], results[1][name], name)
        groups = results[1][name][0]["param_groups"]
        # Rank 0's scheduled learning rate (0.01 halved once) and its initial_lr won.
        assert groups[0]["lr"] == pytest.approx(0.005), name
        assert groups[0]["initial_lr"] == pytest.approx(0.01), name
    assert "LBFGS" in results[0]["LBFGS"]
