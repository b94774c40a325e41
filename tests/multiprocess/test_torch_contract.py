"""Horovod 0.28.1's PyTorch contract where hora used to differ, at 3 then 2 ranks.

Sparse handles, SparseAdam, duplicate process sets, the elastic sampler and
the timeline's row names. One 3-rank job checks everything, then a 2-rank job does it again and
resumes the 3-rank job's sampler state, as an elastic reset to 2 ranks does.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from tests.support.coordinator import CoordinatorProcess
from tests.support.workers import describe, run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def coordinator():
    """A coordinator whose 10 s lease outlasts a worker starved of CPU for a few seconds
    on a busy machine, and lets an elastic job's first world wait for all 3 workers
    (each imports torch first)."""
    with CoordinatorProcess(["--lease-s", "10"]) as started:
        yield started

SCENARIOS = Path(__file__).with_name("scenarios_torch_contract.py")
import scenarios_torch_contract as contract  # noqa: E402  (the test dir is on sys.path)


def horovod_partition(epoch: int, processed_num: int, size: int, seed: int = 5) -> list[list[int]]:
    """Every rank's indices as Horovod 0.28.1's ElasticSampler computes them."""
    order = list(range(contract.SAMPLES))
    random.Random(seed + epoch).shuffle(order)
    remaining = order[processed_num:]
    per_rank = math.ceil(len(remaining) / size)
    padded = remaining + remaining[:per_rank * size - len(remaining)]
    return [padded[r:per_rank * size:size] for r in range(size)]


def check_job(results: list[dict], size: int, resumed_from: int, batches: int) -> None:
    dense = torch.zeros(6, 3)
    for r in range(size):
        dense[r] = r + 1.0
    dense[5] = size
    for rank, out in enumerate(results):
        sparse = out["sparse"]
        assert not sparse["is_int"] and sparse["callable"] and sparse["again_same"]
        torch.testing.assert_close(sparse["sum"], dense)
        torch.testing.assert_close(sparse["average"], dense / size)
        assert sparse["polled"]

        # SparseAdam, both ways, equals one process on the concatenated batch.
        expected = contract.train_sparse_adam(False, size, 0, distributed=False)
        for key in ("adam_dense", "adam_sparse"):
            assert torch.equal(out[key], results[0][key]), f"{key} differs across ranks"
            torch.testing.assert_close(out[key], expected, rtol=1e-5, atol=1e-6)

        sets = out["sets"]
        assert len(sets["errors"]) == 2, sets
        assert all("duplicate process set" in e for e in sets["errors"]), sets["errors"]
        assert "process set 0" in sets["errors"][1]  # the global set's ranks
        first, second = sets["ids"]
        assert second == first + 1, "the refused calls took no set id"
        members = {0: [0, 1] if size > 2 else [0], 1: [1]}
        assert sets["sums"] == [float(len(members[0]))] * (rank in members[0]) + \
            [1.0] * (rank == 1) + [float(size)]
        assert sets["removed"] and sets["again"] == second + 1

        sampler = out["sampler"]
        partition = horovod_partition(0, resumed_from, size)
        mine = partition[rank]
        assert sampler["seen"] == [mine[i:i + contract.BATCH]
                                   for i in range(0, batches * contract.BATCH, contract.BATCH)]
        processed = resumed_from + batches * contract.BATCH * size
        assert sampler["state"] == {"epoch": 0, "processed_num": processed}
        assert sampler["next_epoch"] == horovod_partition(1, 0, size)[rank]
        assert sampler["len"] == math.ceil(contract.SAMPLES / size)


def check_timeline(path: Path) -> None:
    """Rank 0's timeline names rows as Horovod does: <collective>.<tensor name>."""
    events = json.loads(path.read_text())
    rows = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    expected = {
        "allgather.contract.sparse.indices", "allgather.contract.sparse.values",
        "allgather.contract.sparse.avg.values",  # sparse_allreduce_async's allgathers
        "allreduce.weight",  # DistributedOptimizer, sparse_as_dense=True
        "allgather.weight.indices", "allgather.weight.values",  # sparse_as_dense=False
        "allreduce.contract.set1", "allreduce.contract.set0",
    }
    assert expected <= rows, sorted(rows)
    names = {e.get("name") for e in events}
    assert {"NEGOTIATE_ALLGATHER", "ALLGATHER", "NEGOTIATE_ALLREDUCE", "ALLREDUCE"} <= names


def test_horovod_torch_contract_at_three_then_two_ranks(coordinator, tmp_path):
    timeline = tmp_path / "timeline.json"
    three = [r.value for r in run_workers(coordinator, 3, SCENARIOS, "contract",
                                          (None, 2), timeout=150,
                                          env={"HORA_TIMELINE": str(timeline)})]
    check_job(three, 3, 0, 2)
    check_timeline(timeline)
    # Every rank recorded the same batches: each one's state is the job's state.
    state = three[0]["sampler"]["state"]
    assert all(out["sampler"]["state"] == state for out in three)
    two = [r.value for r in run_workers(coordinator, 2, SCENARIOS, "contract",
                                        (state, 3), timeout=150)]
    check_job(two, 2, state["processed_num"], 3)


def horovod_steps(epoch: int, processed_num: int, size: int, samples: int, seed: int
                  ) -> list[list[int]]:
    """What each step of a 0.28.1 loop applies: every rank's next batch, in rank order."""
    order = list(range(samples))
    random.Random(seed + epoch).shuffle(order)
    remaining = order[processed_num:]
    per_rank = math.ceil(len(remaining) / size)
    padded = remaining + remaining[:per_rank * size - len(remaining)]
    shares = [padded[r:per_rank * size:size] for r in range(size)]
    batch = contract.BATCH
    return [[i for share in shares for i in share[k:k + batch]]
            for k in range(0, per_rank, batch)]


def test_sampler_after_a_worker_loss_partitions_as_horovod_does(coordinator):
    samples, kill_step = 48, 4
    results = run_workers(coordinator, 3, SCENARIOS, "sampler_through_a_loss",
                          (samples, kill_step), timeout=150, expect_ok=False,
                          env={"HORA_MIN_SIZE": "2", "HORA_MAX_SIZE": "3"})
    # Ranks follow the order of joining, not of starting: find the one that died.
    killed = [r for r in results if r.returncode == -9]
    survivors = [r for r in results if r.ok]
    assert len(killed) == 1 and len(survivors) == 2, describe(results)
    applied, sizes, state = survivors[0].value
    assert survivors[1].value == (applied, sizes, state)
    assert sizes == [3, 2]
    # commit() saves, then checks with the others (Horovod's order): the
    # survivors saved step 4, whose allgather rank 2 took part in, and failed
    # in the check. The 2 of them split what was left after 4 x 3 x 2 samples.
    done = kill_step * 3 * contract.BATCH
    expected = horovod_steps(0, 0, 3, samples, 3)[:kill_step] + \
        horovod_steps(0, done, 2, samples, 3)
    assert applied == expected
    assert sorted(i for step in applied for i in step) == list(range(samples))
    assert state == {"epoch": 0, "processed_num": samples}
