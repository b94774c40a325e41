"""PyTorch Lightning's Trainer with strategy="horovod" (hora.lightning) on real workers.

A 2-rank fit with gradient accumulation ends with the same weights on both
ranks, equal (to float tolerance) to plain single-process SGD on the whole
batch; checkpoints are written by rank 0 only; metrics logged with
sync_dist are reduced across ranks; the strategy's collectives
(reduce, all_gather, broadcast, barrier, reduce_boolean_decision) agree
with what they mean on Lightning's own DDP strategy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.workers import run_workers

pytest.importorskip("lightning", reason="PyTorch Lightning is not installed "
                    "(pip install 'hora[lightning]'): the Lightning strategy tests are skipped")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

SCENARIOS = Path(__file__).with_name("scenarios_lightning.py")
SIZE, BATCH, ACCUMULATE, EPOCHS = 2, 4, 2, 2
SAMPLES = SIZE * BATCH * ACCUMULATE * 3  # 3 optimizer steps per epoch


def reference(initial: dict, lr: float) -> dict:
    """Single-process SGD where every step sees all ranks' micro-batches at once."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()})
    gen = torch.Generator().manual_seed(1234)
    data = torch.randn(SAMPLES, 6, generator=gen)
    target = torch.randint(0, 3, (SAMPLES,), generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for epoch in range(EPOCHS):
        # Lightning trains through a DistributedSampler(shuffle=True, seed=0) at set_epoch(epoch):
        # one permutation, rank r taking its entries r, r + SIZE, ...
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch)).tolist()
        shards = [order[r::SIZE] for r in range(SIZE)]
        for step in range(SAMPLES // (SIZE * BATCH * ACCUMULATE)):
            micro = range(step * ACCUMULATE, (step + 1) * ACCUMULATE)
            rows = [i for k in micro for shard in shards for i in shard[k * BATCH:(k + 1) * BATCH]]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(data[rows]), target[rows]).backward()
            opt.step()
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def two_ranks(shared_coordinator, tmp_path_factory):
    """One 2-rank run of scenarios_lightning.fit_test_and_collectives: (root, per-rank values)."""
    root = tmp_path_factory.mktemp("lightning")
    results = run_workers(shared_coordinator, SIZE, SCENARIOS, "fit_test_and_collectives",
                          (str(root), BATCH, ACCUMULATE, EPOCHS, SAMPLES), timeout=140)
    return root, [r.value for r in results]


def test_fit_and_test_match_single_process_sgd_and_only_rank_0_writes(two_ranks):
    tmp_path, results = two_ranks
    values = [v["fit"] for v in results]
    for rank, value in enumerate(values):
        assert value["strategy"] == "HorovodStrategy"
        assert value["world"] == (rank, SIZE, rank == 0)
        assert value["rank_zero_only"] == rank
        assert value["global_step"] == EPOCHS * 3

    # Both ranks end with identical weights: rank 0's start, averaged gradients.
    for name, tensor in values[0]["fitted"].items():
        np.testing.assert_array_equal(tensor, values[1]["fitted"][name], err_msg=name)
    # The strategy scales the learning rate by the number of workers (scale_lr=True).
    expected = reference(values[0]["initial"], lr=0.1 * SIZE)
    for name, tensor in expected.items():
        np.testing.assert_allclose(values[0]["fitted"][name], tensor, rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    assert not np.allclose(values[0]["initial"]["0.weight"], values[0]["fitted"]["0.weight"])

    # Checkpoints come from rank 0 only.
    assert values[0]["checkpoints_saved"], "rank 0 wrote no checkpoint"
    assert values[1]["checkpoints_saved"] == []
    assert Path(values[0]["checkpoints_saved"][-1]).exists()
    logs = sorted(p.relative_to(tmp_path).parts[:2] for p in tmp_path.rglob("metrics.csv"))
    assert logs == [("lightning_logs", "version_0")], logs

    # sync_dist metrics are the mean over the ranks, the same on each.
    for value in values:
        assert value["test"]["rank_mean"] == pytest.approx((SIZE - 1) / 2)
        assert value["test"]["test_acc"] == values[0]["test"]["test_acc"]
        assert value["train_loss"] == values[0]["train_loss"]


def test_the_strategy_collectives_across_ranks(two_ranks):
    for rank, result in enumerate(two_ranks[1]):
        value = result["collectives"]
        assert value["same_object"]
        assert value["mean"] == [1.5, 15.0]
        assert value["sum"] == value["sum_enum"] == [3.0, 30.0]
        assert value["max"] == [2.0, 20.0]
        assert value["min"] == [1.0, 10.0]
        assert value["not_a_tensor"] == 7
        assert value["gathered"] == [[0.0, 0.0], [1.0, 1.0]]
        assert value["gathered_scalar"] == [0.0, 1.0]
        assert value["broadcast"] == {"from": 1}
        assert value["all_true"] is False
        assert value["any_true"] is True
        assert value["sampler"] == {"num_replicas": SIZE, "rank": rank}
        assert value["inference_mean"] == [0.5]
