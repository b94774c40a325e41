"""A small model's gradients go as one allreduce from each world's second step on
(hora/torch/_fused.py): the same bits as one by one, on every variant the
optimizer takes, and the errors of one by one when a rank's parameters change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hora.torch._native import hooks_module
from tests.support.workers import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

SCENARIOS = Path(__file__).with_name("scenarios_fused.py")
NATIVE = hooks_module()


# Where the fused allreduce's bytes go: the round's shared-memory payload (the
# default), a payload over the mesh's sockets, or no payload at all (Gloo, with the
# gradients copied into the optimizer's buffer first).
PATHS = {"socket_payload": {"HORA_SHM_ALLREDUCE_BYTES": "0"},
         "no_payload": {"HORA_SHM_ALLREDUCE_BYTES": "0", "HORA_MESH_ALLREDUCE_BYTES": "0"},
         # Gradients copied in and out each step, and set to None by zero_grad().
         "no_views": {"HORA_GRADIENT_VIEWS": "0"},
         # The noting hooks and the buffer's checks in Python, not C++ (hora/torch/_native.py).
         "python_hooks": {"HORA_NATIVE_HOOKS": "0"}}


@pytest.mark.parametrize("variant", ["plain", "fp16", "accumulate", "unused_on_one_rank",
                                     "process_set", "float64", "one_group", "wide",
                                     "wide_three", *PATHS])
def test_fused_steps_equal_one_by_one(shared_coordinator, variant):
    # process_set: the set of ranks 0 and 2.
    size = 3 if variant in ("process_set", "wide_three") else 2
    results = [r.value for r in run_workers(shared_coordinator, size, SCENARIOS, "fused_steps",
                                            (variant,), env=PATHS.get(variant))
               if r.value is not None]
    assert len(results) == (3 if variant == "wide_three" else 2)
    for value in results:
        # At 3 ranks the first occurrence of a name (the first step's gradients,
        # the second step's fused buffer) runs as the coordinator answered, on a
        # Gloo ring, whose order of addition is not the reference's rank order.
        exact = value["equal"][2:] if variant == "wide_three" else value["equal"]
        assert exact == [True] * len(exact), value["equal"]
        assert value["fused"]
        # Views of the buffer, zeroed in place, unless they are off or cast (fp16).
        assert value["none_after_zero_grad"] == (variant in ("fp16", "no_views")), value
        # Gradients past 64 KiB on one machine: the buffer moves into /dev/shm
        # after the world's first step, and the peers read it there
        # (hora_native/mesh_resident.py).
        assert (value["resident"] > 0) == variant.startswith("wide"), value["resident"]
        # Noting hooks (one gradient per parameter per step, one group each): in C++
        # where it is built (make install builds it), unless turned off.
        noting = variant not in ("accumulate", "one_group")
        assert value["native_notes"] == (noting and variant != "python_hooks"
                                         and NATIVE is not None), value
    for key, tensor in results[0]["params"].items():
        assert all(torch.equal(tensor, other["params"][key]) for other in results[1:]), key


def test_the_timeline_shows_the_first_step_one_by_one_then_fused(shared_coordinator, tmp_path):
    timeline = tmp_path / "timeline.json"
    run_workers(shared_coordinator, 2, SCENARIOS, "fused_steps", ("plain",),
                env={"HORA_TIMELINE": str(timeline)})
    rows = {e["args"]["name"] for e in json.loads(timeline.read_text())
            if e.get("name") == "thread_name"}
    assert "allreduce.layers.0.weight" in rows, sorted(rows)
    assert "allreduce.fused.8.extra" in rows, sorted(rows)  # named after the first


def test_a_parameter_that_changes_on_one_rank_fails_every_rank_then_steps_go_on(
        shared_coordinator):
    results = [r.value for r in run_workers(shared_coordinator, 2, SCENARIOS, "fused_misfit")]
    for out in results:
        errors = out["errors"]
        assert errors[:2] == [None, None], errors
        assert errors[2].startswith("InvalidCallError") and "'scale'" in errors[2], errors
        assert "[1]" in errors[2] and "[2]" in errors[2], errors
        assert errors[3].startswith("TensorMismatchError") and "scale" in errors[3], errors
        assert errors[4:] == [None, None], errors
        assert out["after"] == [2.0, 2.0]
    for key, tensor in results[0]["params"].items():
        assert all(torch.equal(tensor, other["params"][key]) for other in results[1:]), key


def test_a_join_sends_every_rank_back_to_checking_one_by_one(shared_coordinator):
    results = [r.value for r in run_workers(shared_coordinator, 2, SCENARIOS,
                                            "fused_after_join", timeout=60)]
    assert [out["last"] for out in results] == [1, 1]
    for out in results:
        assert out["equal"] == [True] * 3, out
        assert out["fused"]


def test_gradients_handled_as_torch_lets_a_script_keep_the_bits_and_the_errors(
        shared_coordinator):
    """From the second step on, the fused gradients are views of one buffer that
    zero_grad() zeroes in place; a script that replaces, clips or zeroes them
    otherwise still gets the one-by-one bits, and the calls that are errors one
    by one are errors fused, each followed by a step that works."""
    results = [r.value for r in run_workers(shared_coordinator, 2, SCENARIOS,
                                            "fused_gradient_handling")]
    for out in results:
        labels = [label for label, _, _ in out["steps"]]
        assert "reshaped" not in labels, out["steps"]  # it raised
        assert [equal for _, equal, _ in out["steps"]] == [True] * len(labels), out["steps"]
        fused = dict((label, went) for label, _, went in out["steps"])
        assert all(fused.values()), fused
        assert out["views"] and out["zeros"], out
        assert "'scale'" in out["reshaped"] and "[1]" in out["reshaped"], out
        assert "was computed again before step()" in out["twice"], out
        assert "zero_grad() was called after loss.backward()" in out["zero_before_step"], out
    for key, tensor in results[0]["params"].items():
        assert all(torch.equal(tensor, other["params"][key]) for other in results[1:]), key


def test_a_parameter_the_buffer_does_not_hold_is_still_zeroed(shared_coordinator):
    results = [r.value for r in run_workers(shared_coordinator, 2, SCENARIOS,
                                            "fused_partial_cover")]
    for out in results:
        assert out["same"], out
        assert out["fused"], out


@pytest.mark.parametrize("variant", ["all", "rank_0", "no_views", "keep_zeros"])
def test_a_sparse_embedding_unused_at_first_gets_sparse_gradients_once_used(
        shared_coordinator, variant):
    results = [r.value for r in run_workers(shared_coordinator, 2, SCENARIOS,
                                            "fused_unused_sparse", (variant,),
                                            env=PATHS.get(variant))]
    for out in results:
        # Unused: None after zero_grad(), dense zeros after synchronize() (Horovod's
        # fill for a parameter without a gradient); used on any rank: sparse on
        # every rank. With set_to_none=False: zeros, and dense, as torch's.
        if variant == "keep_zeros":
            assert out["none"] == [True] * 2 + [False] * 4, out
            assert out["sparse"] == [False] * 6, out
        else:
            assert out["none"] == [True] * 6, out
            assert out["sparse"] == [False] * 3 + [True] * 3, out
        assert out["emb_equal"] == [True] * 6, out
        assert out["dense_equal"] == [True] * 6, out
        assert out["fused"], out
    for mine, theirs in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(mine, theirs)
