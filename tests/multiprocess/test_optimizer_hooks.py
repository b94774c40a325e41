"""The optimizer's noting gradient hooks (hora/torch/_gradient_hooks.py): from a
world's second step on, a small model's hooks only note their gradients; the
steps give the bits of one by one, and each misuse is refused as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.workers import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

SCENARIOS = Path(__file__).with_name("scenarios_hooks.py")


def test_noting_hooks_give_the_same_steps_and_refuse_every_misuse(shared_coordinator):
    results = [r.value for r in run_workers(shared_coordinator, 2, SCENARIOS, "noting_hooks")]
    for out in results:
        steps = {label: (equal, noting) for label, equal, noting in out["steps"]}
        assert all(equal for equal, _ in steps.values()), out["steps"]
        # Handing over in a world's first step; noting from the second on, and
        # after the misuses (each forgot its step only).
        assert steps["first, one by one"][1] is False
        assert steps["second"][1] and steps["third"][1], steps
        for key in ("again", "again_elsewhere", "zero_grad", "skip"):
            assert steps[f"after {key}"][1], (key, steps)
        # Two passes a step go back to counting hooks; one pass notes again
        # once a step has gone through.
        assert not steps["two passes"][1] and not steps["two passes again"][1], steps
        assert not steps["one pass, checked"][1] and steps["one pass"][1], steps
        errors = out["errors"]
        # The gradient that came first in the last step is computed again first:
        # raised by backward, as the handing-over hooks do.
        message, where = errors["again"]
        assert where == "both" and "was computed again before step()" in message, errors
        assert message.startswith("GradientComputedAgainError: "), message
        assert "'a." in message, message
        # A pass that does not reach that gradient: raised at synchronize(),
        # naming the gradient that came twice.
        message, where = errors["again_elsewhere"]
        assert where == "synchronize" and "was computed again before step()" in message
        assert message.startswith("GradientComputedAgainError: "), message
        assert "'b." in message, message
        message, where = errors["zero_grad"]
        assert message.startswith("AssertionError: optimizer.zero_grad() was called after")
        assert where == "zero_grad"
        message, where = errors["skip"]
        assert "still outstanding" in message and where == "step_skipping_synchronize"
        # Refused in backward and caught, then another gradient computed again:
        # refused at synchronize().
        message, where = errors["again_twice"]
        assert where == "synchronize" and "'b." in message, errors
        assert steps["after again_twice"][0], steps
        message, where = errors["no_world"]
        assert "NotInitializedError" in message and where == "both", errors
        # Notes the sentinel never saw, from a world that ended: dropped, as a
        # step begun there is, instead of refusing zero_grad().
        assert out["stale_dropped"] is True, out["stale_dropped"]
        # A step that began with another gradient: handing over from then on.
        assert out["varying"] == [False, True, True, False, False], out["varying"]
    for key, tensor in results[0]["params"].items():
        assert torch.equal(tensor, results[1]["params"][key]), key
