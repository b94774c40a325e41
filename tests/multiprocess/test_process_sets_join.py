"""Process sets side by side, and hvd.join() for uneven data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.workers import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

SCENARIOS = Path(__file__).with_name("scenarios_sets.py")


def test_disjoint_process_sets_at_three_ranks(shared_coordinator):
    results = [r.value for r in run_workers(shared_coordinator, 3, SCENARIOS, "process_sets")]
    sets = {0: [0, 2], 1: [1], 2: [0, 2]}
    for rank, out in enumerate(results):
        ranks = sets[rank]
        n = len(ranks)
        assert out["sizes"] == (n, ranks.index(rank), True, False)
        total = sum(r + 1 for r in ranks)
        torch.testing.assert_close(out["sum"], torch.full((3,), float(total)))
        torch.testing.assert_close(out["avg"], torch.full((3,), total / n))
        gathered = torch.cat([torch.full((r + 1, 2), float(r)) for r in ranks])
        torch.testing.assert_close(out["allgather"], gathered)
        torch.testing.assert_close(out["broadcast"], torch.full((3,), float(ranks[-1] + 1)))
        me = ranks.index(rank)
        a2a = torch.cat([(torch.arange(2.0 * n) + 10 * r)[2 * me:2 * me + 2] for r in ranks])
        torch.testing.assert_close(out["alltoall"], a2a)
        share = 4 // n
        torch.testing.assert_close(out["reducescatter"], torch.full((share, 1), float(total)))
        torch.testing.assert_close(out["grouped"][1], torch.full((3,), 2.0 * total))
        assert f"rank {rank} is not in ProcessSet" in out["not_member"]
        torch.testing.assert_close(out["global"], torch.full((3,), 6.0))
        assert out["removed"] == (True, True)
        assert "has not been added" in out["after_remove"]


@pytest.mark.parametrize("size,op_name", [(2, "Sum"), (3, "Average")])
def test_join_lets_the_others_finish_their_allreduces(shared_coordinator, size, op_name):
    results = [r.value for r in run_workers(shared_coordinator, size, SCENARIOS, "uneven_join",
                                            (op_name,))]
    for rank, (steps, last, after, world) in enumerate(results):
        assert last == size - 1, "the rank with the most data joins last"
        torch.testing.assert_close(after, torch.full((1,), float(size)))
        for step, value in enumerate(steps):
            # Ranks still in the loop at this step contribute rank + 1; joined ones zero.
            active = [r for r in range(size) if step < 2 * (r + 1)]
            total = float(sum(r + 1 for r in active))
            expected = total if op_name == "Sum" else total / world
            torch.testing.assert_close(value, torch.full((2,), expected),
                                       msg=lambda m, s=step, r=rank: f"rank {r} step {s}: {m}")


def test_uneven_training_with_distributed_optimizer_and_join(shared_coordinator):
    results = [r.value for r in run_workers(shared_coordinator, 2, SCENARIOS,
                                            "uneven_training_then_join")]
    (last0, params0), (last1, params1) = results
    assert last0 == last1 == 1
    for key in params0:
        assert torch.equal(params0[key], params1[key]), key


def test_gradients_through_a_process_set_use_the_sets_rank_and_size(shared_coordinator):
    results = [r.value for r in run_workers(shared_coordinator, 3, SCENARIOS,
                                            "process_set_gradients")]
    assert results[0] is None
    for position, rank in enumerate((1, 2)):
        x_grad, y_grad, z_grad = results[rank]
        # d/dx of sum(allgather(x) * w): the members' w averaged (Horovod's
        # definition), at this member's rows.
        torch.testing.assert_close(x_grad, torch.arange(4.0)[2 * position:2 * position + 2])
        # reducescatter's gradient is the allgather of the incoming ones: 1 for
        # Average, times the set's 2 members (not the world's 3 ranks) for Sum.
        torch.testing.assert_close(y_grad, torch.ones(4))
        torch.testing.assert_close(z_grad, torch.full((4,), 2.0))


@pytest.mark.timeout(60)
def test_a_process_set_mistake_on_one_rank_raises_on_every_rank(shared_coordinator):
    # 3 ranks, so that the set [0, 1] is not the global set's ranks (Horovod refuses those).
    results = [r.value for r in run_workers(shared_coordinator, 3, SCENARIOS,
                                            "process_set_misuse", timeout=45)]
    for rank, (errors, total, removed) in enumerate(results):
        assert len(errors) == 3, errors
        assert "rank 1" in errors[0] and "[0, 5]" in errors[0], errors[0]
        assert "rank 0" not in errors[0] and "rank 2" not in errors[0], errors[0]
        assert "rank 1" in errors[1] and "already been added" in errors[1], errors[1]
        assert "rank 1" in errors[2] and "global process set" in errors[2], errors[2]
        if rank < 2:
            torch.testing.assert_close(total, torch.full((1,), 2.0))
        else:
            assert total is None  # not a member
        assert removed is True


@pytest.mark.timeout(90)
def test_a_process_set_must_be_added_again_after_shutdown_and_init(shared_coordinator):
    # 3 ranks: the set [0, 1] is then not the global set's ranks (Horovod refuses those).
    results = [r.value for r in run_workers(shared_coordinator, 3, SCENARIOS,
                                            "process_set_across_init", timeout=60)]
    for rank, (before, stale, after, removed) in enumerate(results):
        assert stale is not None and "add it again" in stale, stale
        if rank < 2:
            torch.testing.assert_close(before, torch.full((1,), 2.0))
            torch.testing.assert_close(after, torch.full((1,), 4.0))
        else:
            assert before is None and after is None  # not a member
        assert removed is True


def test_init_takes_horovods_process_sets_argument(shared_coordinator):
    """``hvd.init(process_sets="dynamic")``, as Horovod documents it, failed: the
    string was taken for a list of ranks."""
    results = [r.value for r in run_workers(shared_coordinator, 3, SCENARIOS,
                                            "init_with_process_sets", timeout=90)]
    for rank, (listed_id, first, second, refused, after) in enumerate(results):
        assert listed_id == 1
        if rank < 2:
            torch.testing.assert_close(first, torch.full((1,), 2.0))
        else:
            assert first is None
        if rank > 0:
            torch.testing.assert_close(second, torch.full((1,), 4.0))
        assert refused is not None and "'dynamic'" in refused, refused
        torch.testing.assert_close(after, torch.full((1,), 3.0))


def test_a_sets_fused_allreduces_beside_the_global_sets_stay_exact(shared_coordinator):
    """Each set's responses run on the set's own engine thread, at the same time as
    the global set's rounds: their fusion buffers must not be shared."""
    results = [r.value for r in run_workers(shared_coordinator, 3, SCENARIOS,
                                            "set_and_global_fusion_side_by_side", (150,),
                                            timeout=140)]
    for rank, out in enumerate(results):
        assert not out["alive"], f"rank {rank}: the set's thread did not finish"
        assert out["count"] == 0, (rank, out["wrong"])
