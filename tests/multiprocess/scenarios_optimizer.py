"""DistributedOptimizer variants, run inside worker processes (see tests/support/workers.py);
test_optimizer_features.py also builds its single-process references from them."""

from __future__ import annotations

import torch

import hora.torch as hvd


class EmbeddingNet(torch.nn.Module):
    """``fc_dtype`` float64: a model of two dtypes (its head in double precision)."""

    def __init__(self, sparse: bool, fc_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 4, sparse=sparse)
        self.fc = torch.nn.Linear(4, 3).to(fc_dtype)

    def forward(self, idx):
        return self.fc(self.emb(idx).mean(1).to(self.fc.weight.dtype))


def variant_batches(size: int, steps: int):
    gen = torch.Generator().manual_seed(99)
    idx = torch.randint(0, 20, (steps, 4 * size, 5), generator=gen)
    target = torch.randint(0, 3, (steps, 4 * size), generator=gen)
    return idx, target


def train_variant(variant: str, steps: int = 3):
    """One DistributedOptimizer feature at a time; returns the final parameters."""
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    sparse = variant in ("sparse", "sparse_as_dense")
    model = EmbeddingNet(sparse=sparse, fc_dtype=torch.float64 if variant == "mixed_groups"
                         else torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    kwargs = {"named_parameters": model.named_parameters()}
    if variant == "groups":
        kwargs["groups"] = 2
    elif variant == "mixed_groups":  # one group of float32 and float64 gradients
        kwargs["groups"] = 1
    elif variant == "explicit_groups":
        kwargs["groups"] = [[model.fc.weight, model.fc.bias]]
    elif variant == "bf16":
        kwargs["compression"] = hvd.Compression.bf16
    elif variant == "sparse_as_dense":
        kwargs["sparse_as_dense"] = True
    elif variant == "predivide":
        kwargs["gradient_predivide_factor"] = 2.0
    opt = hvd.DistributedOptimizer(opt, **kwargs)
    idx, target = variant_batches(size, steps)
    for step in range(steps):
        opt.zero_grad()
        mine = slice(rank * 4, (rank + 1) * 4)
        loss = torch.nn.functional.cross_entropy(model(idx[step, mine]), target[step, mine])
        loss.backward()
        if variant == "skip_synchronize":
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def optimizer_misuse():
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    out = {}
    model(torch.ones(2, 3)).sum().backward()
    try:
        opt.zero_grad()
    except AssertionError as exc:
        out["zero_grad"] = str(exc)
    try:
        with opt.skip_synchronize():
            opt.step()
    except RuntimeError as exc:
        out["skip"] = str(exc)
    opt.step()
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("w", model.weight), ("w", model.bias)])
    except ValueError as exc:
        out["dupes"] = str(exc)
    return out


def backward_after_shutdown():
    """A gradient hook in no world: the first backward pass raises, even when the
    allreduce itself would wait for a second pass (backward_passes_per_step=2)."""
    model = torch.nn.Linear(3, 1)
    hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                             named_parameters=model.named_parameters(),
                             backward_passes_per_step=2)
    hvd.shutdown()
    try:
        model(torch.ones(2, 3)).sum().backward()
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def adasum_optimizer_step():
    """One SGD step with op=Adasum: every rank applies start + adasum(delta_0, delta_1, ...)."""
    rank = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    x = torch.full((4, 3), float(rank + 1)) + torch.arange(3.0) * (rank - 0.5)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    opt.step()
    return start, grads, {k: v.clone() for k, v in model.state_dict().items()}


def every_optimizer_state():
    """Each torch.optim optimizer takes rank-specific steps, then gets rank 0's state."""
    import inspect

    rank = hvd.rank()
    out = {}
    names = [n for n in torch.optim.__all__
             if inspect.isclass(getattr(torch.optim, n, None))
             and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
             and n not in ("Optimizer", "LBFGS")]
    for name in names:
        torch.manual_seed(0)
        sparse = name == "SparseAdam"
        bias = name != "Muon"  # Muon takes 2-D parameters only
        model = (torch.nn.Embedding(10, 4, sparse=True) if sparse
                 else torch.nn.Sequential(torch.nn.Linear(4, 3, bias=bias),
                                          torch.nn.Linear(3, 2, bias=bias)))
        params = list(model.parameters())
        lr = 0.01 * (rank + 1)  # hyperparameters differ per rank until the broadcast
        opt = getattr(torch.optim, name)(params, lr=lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(rank + 1):
            opt.zero_grad()
            if sparse:
                model(torch.randint(0, 10, (6,), generator=gen)).sum().backward()
            else:
                model(torch.randn(5, 4, generator=gen)).pow(2).sum().backward()
            opt.step()
            sched.step()
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # One more identical step everywhere must keep the optimizers identical.
        opt.zero_grad()
        if sparse:
            model(torch.arange(6) % 10).sum().backward()
        else:
            model(torch.ones(5, 4)).pow(2).sum().backward()
        opt.step()
        out[name] = (opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()})
    try:
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(torch.nn.Linear(2, 1).parameters()), 0)
    except ValueError as exc:
        out["LBFGS"] = str(exc)
    return out


def handover_batches():
    """Gradient hooks note small gradients and submit them together: at
    synchronize(), or at once when the noted ones reach HANDOVER_BYTES."""
    from hora.torch.optimizer import HANDOVER_BYTES

    out = {}
    x = torch.full((1, 4), float(hvd.rank() + 1))
    small = torch.nn.Linear(4, 4, bias=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(small.parameters(), lr=0.1),
                                   named_parameters=small.named_parameters())
    small(x).sum().backward()
    out["small_in_flight"] = len(opt._pending)
    out["small_noted"] = len(opt._handed)
    opt.synchronize()
    out["small_grad"] = small.weight.grad.clone()  # the average of ranks' x: 1.5
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    # A gradient noted but not submitted yet, computed again: the same error as
    # for one in flight.
    small(x).sum().backward()
    try:
        small(x).sum().backward()
    except AssertionError as exc:  # Horovod's class (and a RuntimeError, as before)
        out["again"] = f"{type(exc).__name__}: {exc}"
    opt.synchronize()
    opt.zero_grad()
    # A gradient of HANDOVER_BYTES goes while backward runs.
    width = int((HANDOVER_BYTES // 4) ** 0.5)
    big = torch.nn.Linear(width, width, bias=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(big.parameters(), lr=0.1),
                                   named_parameters=big.named_parameters())
    big(torch.ones(1, width)).sum().backward()
    out["big_in_flight"] = len(opt._pending)
    out["big_noted"] = len(opt._handed)
    opt.step()
    return out


def handover_one_call():
    """The noted gradients reach the engine in one call, each under its own name,
    and come back as their own allreduces would; a batch holding a gradient no
    reduction takes goes one by one, so that the call fails on every rank."""
    from hora import _runtime
    from hora._ops import ReduceOp
    from hora.errors import InvalidCallError
    from hora.torch._collectives import _allreduce_entry
    from hora.world import wait

    out = {}
    x = torch.full((2, 3), float(hvd.rank() + 1))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(4)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(x).sum().backward()
    local = [p.grad.clone() for p in model.parameters()]
    expected = [hvd.allreduce(g, name=f"check.{i}") for i, g in enumerate(local)]
    opt._submit_handed()
    out["pending"] = [len(p.params) for p in opt._pending]
    opt.synchronize()
    out["equal"] = [torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected, strict=True)]
    # A complex gradient among real ones: every rank gets the InvalidCallError of
    # that tensor, and the next collective works.
    # Each gradient is compressed once, also when the batch goes one by one (a
    # compression may keep state, such as an error-feedback residual).
    compressed = []

    class Counting(hvd.Compression.none):
        @staticmethod
        def compress(tensor):
            compressed.append(tensor.dtype)
            return tensor, None

    lin = torch.nn.Linear(3, 3)
    c = torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([lin.weight, lin.bias, c], lr=0.1),
        named_parameters=[("w", lin.weight), ("b", lin.bias), ("c", c)], compression=Counting)
    (lin(x).sum() + (c * c).real.sum()).backward()
    try:
        opt.synchronize()
    except InvalidCallError as exc:
        out["invalid"] = str(exc)
    out["compressed"] = len(compressed)
    out["after"] = hvd.allreduce(torch.ones(2), name="after", op=hvd.Sum)
    # The engine takes a batch whole or not at all: a name twice in it raises,
    # and none of it is in flight.
    engine = _runtime.current().engine

    def entry(name):
        return _allreduce_entry(torch.full((2,), float(hvd.rank() + 1)), name, ReduceOp.SUM,
                                1.0, 1.0, 0)

    try:
        engine.enqueue_all([entry("one"), entry("one")])
    except InvalidCallError as exc:
        out["twice"] = str(exc)
    out["in_flight"] = sorted(engine._pending.entries)
    batch = [entry("one"), entry("two")]
    engine.enqueue_all(batch)
    out["batch"] = [wait(e.handle).tolist() for e in batch]
    # So does a grouped call: with 'g.1' in flight on rank 0, its group 'g' (of
    # 'g.0' and 'g.1') raises there and leaves 'g.0' out of flight as well.
    one = torch.ones(2)
    if hvd.rank() == 0:
        single = hvd.allreduce_async_(one, name="g.1", op=hvd.Sum)
        try:
            hvd.grouped_allreduce_async_([torch.ones(2), torch.ones(2)], name="g")
        except InvalidCallError as exc:
            out["group_clash"] = str(exc)
        out["group_in_flight"] = sorted(engine._pending.entries)
        hvd.allreduce(torch.ones(1), name="sync")
    else:
        hvd.allreduce(torch.ones(1), name="sync")
        single = hvd.allreduce_async_(one, name="g.1", op=hvd.Sum)
    hvd.synchronize(single)
    out["group"] = [t.tolist() for t in hvd.grouped_allreduce(
        [torch.ones(2), torch.ones(2)], name="g", op=hvd.Sum)]
    return out
