"""The optimizer's noting gradient hooks (hora/torch/_gradient_hooks.py), run
inside worker processes (see tests/support/workers.py): each step's gradients
against the same gradients allreduced one by one, and every misuse those hooks
must refuse as the handing-over hooks do, each followed by a step that works."""

from __future__ import annotations

import torch

import hora.torch as hvd


class Heads(torch.nn.Module):
    """A trunk and two heads: ``a`` trains the trunk, ``b`` reads its output detached."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(4, 4)
        self.a = torch.nn.Linear(4, 1)
        self.b = torch.nn.Linear(4, 1)


def noting_hooks():
    """Steps of two backward passes over disjoint parameters (allowed: each
    gradient once), then the misuses. Returns, per step, whether the gradients
    equal the one-by-one reference and whether the hooks were noting; each
    misuse's error and where it surfaced; the final parameters."""
    rank = hvd.rank()
    torch.manual_seed(0)
    model = Heads()
    params = list(model.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    out: dict = {"steps": [], "errors": {}}
    batches = iter(range(1000))

    def x() -> torch.Tensor:
        gen = torch.Generator().manual_seed(100 * next(batches) + rank)
        return torch.randn(3, 4, generator=gen)

    def both() -> None:
        hidden = torch.tanh(model.trunk(x()))
        model.a(hidden).sum().backward()
        model.b(hidden.detach()).pow(2).sum().backward()

    def only_b() -> None:
        model.b(torch.tanh(model.trunk(x())).detach()).sum().backward()

    def step(label: str, passes: int = 1) -> None:
        opt.zero_grad()
        for _ in range(passes):
            both()
        noting = opt._hooks.noting
        expected = [hvd.allreduce(p.grad.clone(), name=f"reference.{label}.{i}")
                    for i, p in enumerate(params)]
        opt.synchronize()
        equal = all(torch.equal(p.grad, e) for p, e in zip(params, expected, strict=True))
        with opt.skip_synchronize():
            opt.step()
        out["steps"].append((label, equal, noting))

    def refused(key: str, first, then, error: type[Exception]) -> None:
        """``first`` then ``then``, which must raise ``error``: kept under ``key``
        with where it surfaced; the step is synchronized away, then one must work."""
        opt.zero_grad()
        first()
        message, where = "none", "not raised"
        try:
            then()
        except error as exc:
            message, where = f"{type(exc).__name__}: {exc}", then.__name__
        try:
            opt.synchronize()
        except error as exc:  # (raised there, the step is forgotten)
            if where == "not raised":
                message, where = f"{type(exc).__name__}: {exc}", "synchronize"
        out["errors"][key] = (message, where)
        step(f"after {key}")

    for label in ("first, one by one", "second", "third"):
        step(label)
    # A second backward pass through head a: its first gradient raises at once.
    refused("again", both, both, AssertionError)  # (Horovod's class)
    # A second pass through head b alone: its hook is one of those that only note,
    # and synchronize() finds the gradient that came twice.
    refused("again_elsewhere", both, only_b, AssertionError)
    refused("zero_grad", both, opt.zero_grad, AssertionError)

    def again_then_more() -> None:
        """A refused pass, caught; then a pass that computes head b again."""
        try:
            both()
        except RuntimeError:
            pass
        only_b()

    refused("again_twice", both, again_then_more, RuntimeError)

    def step_skipping_synchronize() -> None:
        with opt.skip_synchronize():
            opt.step()

    refused("skip", both, step_skipping_synchronize, RuntimeError)
    # A completed join starts a new round of checks: one step one by one (the
    # noted gradients handed over), then fused again.
    out["join"] = hvd.join()
    step("after join")
    step("after join, fused")
    # Two passes a step: the hooks count them again.
    opt.set_backward_passes_per_step(2)
    step("two passes", passes=2)
    step("two passes again", passes=2)
    opt.set_backward_passes_per_step(1)
    step("one pass, checked")
    step("one pass")
    out["params"] = {k: v.clone() for k, v in model.state_dict().items()}
    # A second model whose steps begin with another gradient now and then
    # (heads by turns): its hooks hand over for good after the first such step.
    other = Heads()
    other_opt = hvd.DistributedOptimizer(
        torch.optim.SGD(other.parameters(), lr=0.1),
        named_parameters=[(f"other.{n}", p) for n, p in other.named_parameters()])

    def other_step(b_first: bool) -> bool:
        other_opt.zero_grad()
        hidden = torch.tanh(other.trunk(x()))
        losses = [other.a(hidden).sum(), other.b(hidden.detach()).sum()]
        for loss in reversed(losses) if b_first else losses:
            loss.backward()
        noting = other_opt._hooks.noting
        other_opt.step()
        return noting

    out["varying"] = [other_step(b_first) for b_first in (False, False, True, False, False)]
    # Notes of a pass the sentinel did not reach, then the world ends: dropped.
    opt.zero_grad()
    only_b()
    hvd.shutdown()
    try:
        opt.zero_grad()
        out["stale_dropped"] = True
    except AssertionError as exc:
        out["stale_dropped"] = str(exc)
    try:
        both()
    except ValueError as exc:
        out["errors"]["no_world"] = (f"{type(exc).__name__}: {exc}", "both")
    return out
