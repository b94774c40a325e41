"""Horovod's semantics at 2 and 3 ranks: every dtype, every gradient, every invalid call.

The sections live in ``tests/e2e/horovod_semantics.py``, which also runs
whole under ``horovodrun`` (tests/e2e/test_horovod_semantics.py); here each
runs on ``hora.torch`` with a real coordinator and real Gloo, so a failure
names its section.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.workers import describe, run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

SCRIPT = Path(__file__).resolve().parents[1] / "e2e" / "horovod_semantics.py"
EMPTY = SCRIPT.with_name("horovod_empty.py")


@pytest.mark.parametrize("size", [2, 3])
def test_every_dtype_in_every_collective_and_process_set(shared_coordinator, size):
    results = run_workers(shared_coordinator, size, SCRIPT, "dtype_matrix", timeout=200)
    for r in results:
        assert r.value["failed"] == 0, r.value["failures"]
        assert r.value["checks"] > 0
    # uint8 .. bool (10 dtypes) x dims 1-3 x the global set and a set.
    assert results[0].value["checks"] >= 10 * 3 * 2 * 20


@pytest.mark.parametrize("size", [2, 3])
def test_empty_tensors_in_every_dtype_and_collective(shared_coordinator, size):
    # Zero rows, zero trailing extents, a rank sending nothing, numpy's zero strides;
    # uint16/32/64 as TensorFlow hands them over. Every later call must work too.
    results = run_workers(shared_coordinator, size, EMPTY, "empty_tensors", timeout=200)
    for r in results:
        assert r.value["failed"] == 0, r.value["failures"]
    # 13 dtypes x 2 stride kinds x 2 sets x at least 9 data-moving checks.
    assert results[0].value["checks"] >= 13 * 2 * 2 * 9


@pytest.mark.parametrize("size", [2, 3])
def test_gradients_follow_horovods_definitions(shared_coordinator, size):
    results = run_workers(shared_coordinator, size, SCRIPT, "gradients", timeout=200)
    for r in results:
        assert r.value["failed"] == 0, r.value["failures"]
    assert results[0].value["checks"] >= 3 * 2 * 20


@pytest.mark.parametrize("size", [2, 3])
def test_each_invalid_call_fails_on_every_rank_and_the_next_call_works(shared_coordinator,
                                                                        size):
    results = run_workers(shared_coordinator, size, SCRIPT, "invalid_calls", timeout=200)
    calls = None
    for r in results:
        assert r.value["collectives_ok_after"], describe(results)
        for item in r.value["results"]:
            assert item["raised"] is not None, f"rank {r.rank}: {item['call']} did not raise"
            assert not item["raised"].startswith("NOT"), f"rank {r.rank}: {item}"
            assert item["next_ok"], f"rank {r.rank}: the call after {item['call']} failed"
        names = [item["call"] for item in r.value["results"]]
        assert calls is None or names == calls
        calls = names
    assert len(calls) >= 30


def test_a_call_invalid_on_one_rank_names_that_rank_on_every_rank(shared_coordinator):
    results = run_workers(shared_coordinator, 3, SCRIPT, "invalid_calls", timeout=200)
    for r in results:
        found = {item["call"]: item["raised"] for item in r.value["results"]}
        raised = found["broadcast root out of range on one rank"]
        assert raised.startswith("InvalidCallError"), raised
        assert "rank 0: root_rank 6 is outside the world of size 3" in raised, raised
        assert "rank 1" not in raised and "rank 2" not in raised, raised
        assert found["allreduce invalid on one rank"].startswith("InvalidCallError")
        assert "rank 2: allreduce cannot reduce torch.complex64" in \
            found["allreduce invalid on one rank"]
        assert found["allreduce shapes differ"].startswith("TensorMismatchError")
        assert found["allreduce of a list"].startswith("InvalidTypeError")


@pytest.mark.parametrize("size", [2, 3])
def test_tensors_made_in_inference_mode_go_through_every_collective(shared_coordinator, size):
    # Lightning's validation and test loops run under torch.inference_mode().
    results = run_workers(shared_coordinator, size, SCRIPT, "inference_mode", timeout=200)
    for r in results:
        assert r.value["failed"] == 0, r.value["failures"]
    assert results[0].value["checks"] >= 2 * 2 * 20
