"""A small model's gradients allreduced as one (hora/torch/_fused.py), run inside
worker processes (see tests/support/workers.py): every step's gradients against
the same gradients allreduced one by one, and the invalid calls around it."""

from __future__ import annotations

import torch

import hora.torch as hvd
from hora.errors import InvalidCallError, TensorMismatchError


class Net(torch.nn.Module):
    """Three layers and two parameters of their own: ``extra`` only rank 0 uses
    (in the variant that says so), ``scale`` a vector whose shape a rank may change."""

    def __init__(self, dtype: torch.dtype = torch.float32, width: int = 5) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Tanh(),
                                          torch.nn.Linear(width, 4), torch.nn.Tanh(),
                                          torch.nn.Linear(4, 2)).to(dtype)
        self.extra = torch.nn.Parameter(torch.ones(2, dtype=dtype))
        self.scale = torch.nn.Parameter(torch.full((2,), 0.5, dtype=dtype))

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        y = self.layers(x) * self.scale
        return y * self.extra if use_extra else y


def _batch(step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + hvd.rank())
    return torch.randn(4, 3, generator=gen).to(dtype)


def _expected(params, step: int, wire: torch.dtype | None, pset,
              grads: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """This step's gradients allreduced one by one, as the optimizer's first step
    does (an unused parameter contributes zeros; a sparse gradient, its dense
    values). ``grads``: this rank's gradients, where the parameters' own may
    be in flight already (a group's, handed over by the hook of its last
    gradient while backward runs)."""
    out = []
    params = list(params)
    for i, (p, grad) in enumerate(zip(params, grads or [p.grad for p in params], strict=True)):
        local = grad.clone().to_dense() if grad is not None else torch.zeros_like(p)
        sent = local.to(wire) if wire is not None else local
        if pset.size() > 2:
            # Each element's terms added in rank order, then scaled, as the mesh
            # does (a Gloo ring's order, which a first allreduce of a name takes,
            # depends on the element's place: bits differ beyond 2 ranks).
            terms = hvd.allgather(sent.unsqueeze(0), name=f"reference.{step}.{i}",
                                  process_set=pset)
            got = terms[0]
            for term in terms[1:]:
                got = got + term
            got = got.mul_(1.0 / pset.size())
        else:
            got = hvd.allreduce(sent, name=f"reference.{step}.{i}", process_set=pset)
        out.append(got.to(p.dtype))
    return out


def _step_against_reference(opt, model: Net, step: int, wire: torch.dtype | None,
                            pset, grads: list[torch.Tensor | None] | None = None) -> bool:
    """Synchronizes and steps; whether every gradient after synchronize()
    equals the one-by-one reference bit for bit (``grads``: see ``_expected``)."""
    expected = _expected(model.parameters(), step, wire, pset, grads)
    opt.synchronize()
    equal = all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected,
                                                        strict=True))
    with opt.skip_synchronize():
        opt.step()
    return equal


def _went_fused(opt) -> bool:
    """Whether the last steps went fused (the world's first step checked every
    gradient, and the last one succeeded)."""
    return opt._fused is not None and opt._fused.validated is not None


def fused_steps(variant: str, steps: int = 5):
    """Trains ``steps`` steps; for each, whether every gradient after synchronize()
    equals the one-by-one reference bit for bit, and the final parameters."""
    torch.manual_seed(0)
    dtype = torch.float64 if variant == "float64" else torch.float32
    # Gradients of 130 KB: past the size below which the buffer stays private.
    width = 4096 if variant.startswith("wide") else 5
    model = Net(dtype, width)
    kwargs = {"named_parameters": model.named_parameters()}
    wire = None
    if variant == "fp16":
        kwargs["compression"] = hvd.Compression.fp16
        wire = torch.float16
    elif variant == "accumulate":
        kwargs["backward_passes_per_step"] = 2
    elif variant == "one_group":
        kwargs["groups"] = 1
    pset = hvd.global_process_set
    if variant == "process_set":  # in a world of 3
        pset = hvd.add_process_set([0, 2])
        if hvd.rank() == 1:
            return None
        kwargs["process_set"] = pset
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    equal = []
    for step in range(steps):
        opt.zero_grad()
        passes = 2 if variant == "accumulate" else 1
        use_extra = hvd.rank() == 0 if variant == "unused_on_one_rank" else True
        # The same passes on a copy without the optimizer's hooks: this rank's
        # own gradients, which a group's allreduce, started by the hook of its
        # last gradient, may have overwritten in the model before they are read.
        shadow = Net(dtype, width)
        shadow.load_state_dict(model.state_dict())
        for k in range(passes):
            shadow(_batch(10 * step + k, dtype), use_extra).pow(2).sum().backward()
        for k in range(passes):
            model(_batch(10 * step + k, dtype), use_extra).pow(2).sum().backward()
        equal.append(_step_against_reference(opt, model, step, wire, pset,
                                             [p.grad for p in shadow.parameters()]))
    fused = _went_fused(opt)
    opt.zero_grad()
    from hora import _runtime

    return {"equal": equal, "fused": fused,
            # Rounds whose payload was the optimizer's buffer in /dev/shm, read in place.
            "resident": _runtime._runtime.engine.resident_payloads,
            # Noted by the C++ hooks (hora/torch/_native.py), or by Python's.
            "native_notes": type(opt._hooks.noted).__name__ == "NativeNotes",
            "none_after_zero_grad": all(p.grad is None for p in model.parameters()),
            "params": {k: v.clone() for k, v in model.state_dict().items()}}


def fused_misfit():
    """A parameter that changes shape on one rank after the fused steps began:
    every rank gets the error, then the next step checks each gradient (the
    coordinator's mismatch, naming the parameter), and once the shape is back
    the steps go on, fused again."""
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    out: dict = {"errors": []}

    def step(n: int) -> None:
        opt.zero_grad()
        model(_batch(n), True).pow(2).sum().backward()
        try:
            opt.step()
            out["errors"].append(None)
        except (InvalidCallError, TensorMismatchError) as exc:
            out["errors"].append(f"{type(exc).__name__}: {exc}")

    step(0)  # checked one by one
    step(1)  # fused
    kept = model.scale.data
    if hvd.rank() == 1:
        model.scale.data = torch.full((1,), 0.5)  # broadcasts in forward: the step runs
    step(2)  # fused: invalid on rank 1, an error on both
    step(3)  # one by one: the coordinator's mismatch for 'scale'
    model.scale.data = kept
    step(4)  # one by one again, and fine
    step(5)  # fused
    out["after"] = hvd.allreduce(torch.ones(2), name="after.misfit", op=hvd.Sum).tolist()
    out["params"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def fused_after_join():
    """Rank 0 has no batches in the first epoch and joins at once, while rank 1
    checks its first step one by one and then steps fused; after the join
    completes, both must take the same path in the next epoch (one by one
    first, then fused), or each waits for names the other never sends. (Their
    parameters differ by then: rank 0 did not step while it had joined.)"""
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    batches = {0: 0, 1: 3}[hvd.rank()]
    for n in range(batches):
        opt.zero_grad()
        model(_batch(n), True).pow(2).sum().backward()
        opt.step()
    last = hvd.join()
    equal = []
    for n in range(3):
        opt.zero_grad()
        model(_batch(100 + n), True).pow(2).sum().backward()
        equal.append(_step_against_reference(opt, model, 100 + n, None,
                                             hvd.global_process_set))
    return {"last": last, "fused": _went_fused(opt), "equal": equal}


def fused_gradient_handling():
    """Fused steps whose gradients the script handles as torch lets it: each
    step against the one-by-one reference, and each invalid call followed by
    a step that must still work. Returns the steps' outcomes in order."""
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref = hvd.global_process_set
    out: dict = {"steps": []}
    n = iter(range(1000))

    def backward() -> None:
        model(_batch(next(n)), True).pow(2).sum().backward()

    def checked(label: str) -> None:
        out["steps"].append((label, _step_against_reference(opt, model, next(n), None, ref),
                             _went_fused(opt)))

    for label in ("first, one by one", "fused"):
        opt.zero_grad()
        backward()
        checked(label)
    # The gradients are views of the buffer now, zeroed in place.
    flat = opt._fused.flat.untyped_storage().data_ptr()
    out["views"] = all(p.grad.untyped_storage().data_ptr() == flat
                       for p in model.parameters())
    opt.zero_grad()
    out["zeros"] = all(p.grad is not None and not p.grad.any() for p in model.parameters())
    backward()
    checked("after zero_grad in place")
    # Converted and back on every rank (Module._apply gives the gradients new
    # storage and keeps the tensors).
    model.double()
    model.float()
    opt.zero_grad()
    backward()
    checked("converted and back")
    # The same between zero_grad() and backward: the views are the gradients
    # still, but no longer hold their bytes.
    opt.zero_grad()
    model.double()
    model.float()
    backward()
    checked("converted and back after zero_grad")
    # A gradient replaced by a new tensor between backward and step.
    opt.zero_grad()
    backward()
    model.scale.grad = model.scale.grad * (hvd.rank() + 2)
    checked("a gradient replaced")
    # Clipped in place.
    opt.zero_grad()
    backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    checked("clipped in place")
    # The module's zero_grad (sets every gradient to None), then the optimizer's
    # zero_grad(set_to_none=False) (zeroes them in place).
    model.zero_grad()
    backward()
    checked("module zero_grad")
    opt.zero_grad(set_to_none=False)
    backward()
    checked("zero_grad(set_to_none=False)")
    def refused_then_a_step(key: str, call, error: type[Exception], label: str) -> None:
        """After a backward pass, ``call`` must raise ``error`` (kept under
        ``key``); the step is synchronized away and the next one must work."""
        opt.zero_grad()
        backward()
        try:
            call()
        except error as exc:
            out[key] = str(exc)
        opt.synchronize()
        opt.zero_grad()
        backward()
        checked(label)

    # Two backward passes before step(), and zero_grad() between backward and
    # step(): the errors of one by one, each followed by a step.
    refused_then_a_step("twice", backward, AssertionError, "after two backward passes")
    refused_then_a_step("zero_before_step", opt.zero_grad, AssertionError,
                        "after zero_grad before step")
    # Every rank gives a parameter new data of the same shape and dtype.
    with torch.no_grad():
        model.scale.data = model.scale.data.clone()
    opt.zero_grad()
    backward()
    checked("new data, same shape")
    opt.zero_grad()
    backward()
    checked("fused again")
    # Every rank gives a parameter new data of another shape: one step fails
    # on every rank, the next checks one by one, then fused again.
    model.scale.data = torch.full((1,), 0.5)
    for label in ("reshaped", "reshaped, one by one", "reshaped, fused"):
        opt.zero_grad()
        backward()
        try:
            checked(label)
        except InvalidCallError as exc:
            out["reshaped"] = str(exc)
    out["params"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def fused_partial_cover():
    """A parameter frozen when the optimizer was wrapped, unfrozen later: the
    fused buffer does not hold it, and zero_grad() must still clear it. Two
    steps on the same batch at lr 0 give the same gradients."""
    torch.manual_seed(0)
    model = Net()
    model.extra.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters())
    model.extra.requires_grad_(True)
    grads = []
    for _ in range(4):
        opt.zero_grad()
        model(_batch(7), True).pow(2).sum().backward()
        opt.step()
        grads.append(model.extra.grad.clone())
    return {"same": all(torch.equal(g, grads[0]) for g in grads), "fused": _went_fused(opt)}


def fused_unused_sparse(variant: str):
    """An ``Embedding(sparse=True)`` unused in the first steps, then used (by
    every rank, or by rank 0 only in the variant ``"rank_0"``): once used, its
    gradient is sparse after synchronize(), as with Horovod (the fused steps
    before gave it zeros, and must not have left it a dense view that
    backward then adds the sparse gradient into), on every rank (a rank that
    did not use it makes the same call and gets the same gradient). With
    ``zero_grad(set_to_none=False)`` from the third step on (variant
    ``"keep_zeros"``) the zeros stay, as with torch, and the gradient stays
    dense. zero_grad() is called twice a step. Per step: whether the embedding's gradient was None after
    zero_grad(), whether it was sparse after synchronize(), whether it
    matched the dense reference, and whether every other gradient matched
    its reference bit for bit."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(6, 3, sparse=True)
    head = torch.nn.Linear(3, 2)
    params = [emb.weight, *head.parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1),
                                   named_parameters=[("emb", emb.weight),
                                                     *head.named_parameters()])
    out: dict = {"none": [], "sparse": [], "emb_equal": [], "dense_equal": []}
    for step in range(6):
        for _ in range(2):
            opt.zero_grad(set_to_none=variant != "keep_zeros" or step < 2)
        out["none"].append(emb.weight.grad is None)
        gen = torch.Generator().manual_seed(100 * step + hvd.rank())
        x = torch.randn(4, 3, generator=gen)
        if step >= 3 and (variant != "rank_0" or hvd.rank() == 0):  # from the fourth step on
            x = x + emb(torch.randint(0, 6, (4,), generator=gen))
        head(x).pow(2).sum().backward()
        expected = _expected(params, step, None, hvd.global_process_set)
        opt.synchronize()
        grad = emb.weight.grad
        out["sparse"].append(grad is not None and grad.is_sparse)
        out["emb_equal"].append(grad is not None
                                and torch.allclose(grad.to_dense(), expected[0]))
        out["dense_equal"].append(all(torch.equal(p.grad, e) for p, e in
                                      zip(params[1:], expected[1:], strict=True)))
        with opt.skip_synchronize():
            opt.step()
    out["fused"] = _went_fused(opt)
    out["params"] = [p.detach().clone() for p in params]
    return out
