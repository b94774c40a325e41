"""Process sets and join, run inside worker processes (see tests/support/workers.py)."""

from __future__ import annotations

import torch

import hora.torch as hvd


def process_set_gradients():
    """Gradients of allgather and of an averaging reducescatter inside the set {1, 2}."""
    pset = hvd.add_process_set([1, 2])
    out = None
    if pset.included():
        x = torch.ones(2, requires_grad=True)
        (hvd.allgather(x, process_set=pset) * torch.arange(4.0)).sum().backward()
        y = torch.ones(4, requires_grad=True)
        hvd.reducescatter(y, op=hvd.Average, process_set=pset).sum().backward()
        z = torch.ones(4, requires_grad=True)
        hvd.reducescatter(z, op=hvd.Sum, process_set=pset).sum().backward()
        out = (x.grad, y.grad, z.grad)
    hvd.remove_process_set(pset)
    return out


def process_sets():
    """At 3 ranks: sets [0, 2] and [1] side by side, then back to the global set."""
    rank = hvd.rank()
    even = hvd.add_process_set([0, 2])
    odd = hvd.add_process_set(hvd.ProcessSet([1]))
    mine, other = (even, odd) if rank in (0, 2) else (odd, even)
    x = torch.ones(3) * (rank + 1)
    out = {"sizes": (mine.size(), mine.rank(), mine.included(), other.included())}
    # The same names in both sets at once: each set negotiates its own.
    out["sum"] = hvd.allreduce(x, op=hvd.Sum, name="ps.sum", process_set=mine)
    out["avg"] = hvd.allreduce(x, name="ps.avg", process_set=mine)
    out["allgather"] = hvd.allgather(torch.full((rank + 1, 2), float(rank)), name="ps.ag",
                                     process_set=mine)
    out["broadcast"] = hvd.broadcast(x, root_rank=mine.ranks[-1], name="ps.bc",
                                     process_set=mine)
    out["alltoall"] = hvd.alltoall(torch.arange(2.0 * mine.size()) + 10 * rank, name="ps.a2a",
                                   process_set=mine)
    out["reducescatter"] = hvd.reducescatter(torch.ones(4, 1) * (rank + 1), op=hvd.Sum,
                                             name="ps.rs", process_set=mine)
    out["grouped"] = hvd.grouped_allreduce([x, x * 2], op=hvd.Sum, name="ps.grp",
                                           process_set=mine)
    try:
        hvd.allreduce(x, name="ps.bad", process_set=other)
    except ValueError as exc:
        out["not_member"] = str(exc)
    out["global"] = hvd.allreduce(x, op=hvd.Sum, name="ps.global")
    out["removed"] = (hvd.remove_process_set(even), hvd.remove_process_set(odd))
    try:
        hvd.allreduce(x, name="ps.after", process_set=mine)
    except ValueError as exc:
        out["after_remove"] = str(exc)
    return out


def process_set_misuse():
    """At 3 ranks, each mistake made on rank 1 only; every rank must get the error.

    The set is [0, 1], not the whole world: Horovod refuses a set with the
    global set's ranks.
    """
    errors = []
    bad = [0, 5] if hvd.rank() == 1 else [0, 1]  # rank 5 does not exist
    try:
        hvd.add_process_set(bad)
    except ValueError as exc:
        errors.append(str(exc))
    pset = hvd.add_process_set([0, 1])
    again = pset if hvd.rank() == 1 else hvd.ProcessSet([0, 1])  # added twice on rank 1
    try:
        hvd.add_process_set(again)
    except ValueError as exc:
        errors.append(str(exc))
    target = hvd.global_process_set if hvd.rank() == 1 else pset
    try:
        hvd.remove_process_set(target)
    except ValueError as exc:
        errors.append(str(exc))
    # Nothing was lost: the set still works and is removed cleanly afterwards.
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="misuse.after", process_set=pset) \
        if pset.included() else None
    removed = hvd.remove_process_set(pset)
    return errors, total, removed


def process_set_across_init():
    """A set added before shutdown()/init() must be added again, not silently reused.

    At 3 ranks: the set [0, 1] is not the global set's ranks (which Horovod refuses).
    """
    pset = hvd.add_process_set([0, 1])
    member = pset.included()
    before = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="pset.before", process_set=pset) \
        if member else None
    hvd.shutdown()
    hvd.init()
    try:
        hvd.allreduce(torch.ones(1), name="pset.stale", process_set=pset)
        stale = None
    except ValueError as exc:
        stale = str(exc)
    hvd.add_process_set(pset)
    after = hvd.allreduce(torch.ones(1) * 2, op=hvd.Sum, name="pset.after", process_set=pset) \
        if member else None
    return before, stale, after, hvd.remove_process_set(pset)


def init_with_process_sets():
    """Horovod's ``hvd.init(process_sets=...)``: a list of sets, or "dynamic"
    (none now, any later); anything else is refused before joining. At 3 ranks."""
    rank = hvd.rank()
    hvd.shutdown()
    listed = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[listed])
    first = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="init.listed",
                          process_set=listed) if listed.included() else None
    listed_id = listed.process_set_id
    hvd.shutdown()
    hvd.init(process_sets="dynamic")
    later = hvd.add_process_set([1, 2])
    second = hvd.allreduce(torch.ones(1) * 2, op=hvd.Sum, name="init.dynamic",
                           process_set=later) if rank > 0 else None
    hvd.shutdown()
    try:
        hvd.init(process_sets="static")
        refused = None
    except ValueError as exc:
        refused = str(exc)
    hvd.init(process_sets="DYNAMIC")  # (the worker's harness shuts it down)
    return listed_id, first, second, refused, hvd.allreduce(torch.ones(1), op=hvd.Sum,
                                                            name="init.after")


def uneven_join(op_name: str):
    """Rank r has 2 * (r + 1) batches; whoever runs out joins."""
    rank, size = hvd.rank(), hvd.size()
    results = []
    for step in range(2 * (rank + 1)):
        results.append(hvd.allreduce(torch.ones(2) * (rank + 1), name=f"step.{step}",
                                     op=getattr(hvd, op_name)))
    last = hvd.join()
    # After everyone joined, collectives work as before.
    after = hvd.allreduce(torch.ones(1), name="after.join", op=hvd.Sum)
    return results, last, after, size


def uneven_training_then_join():
    """DistributedOptimizer with uneven data: join, then take the last rank's model."""
    rank = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3 + 2 * rank):
        opt.zero_grad()
        model(torch.randn(8, 4, generator=gen)).pow(2).mean().backward()
        opt.step()
    last = hvd.join()
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    return last, {k: v.clone() for k, v in model.state_dict().items()}


def set_and_global_fusion_side_by_side(rounds: int):
    """At 3 ranks: the set {0, 1} runs fused allreduces (on its own thread in the
    engine) while the global set's run; every result must be exact."""
    import threading

    rank = hvd.rank()
    pset = hvd.add_process_set([0, 1])
    wrong: list[str] = []

    def inputs(i: int, scale: float) -> list[torch.Tensor]:
        return [torch.full((256 + 64 * j,), scale * (rank + 1) * (i + 1) + j) for j in range(4)]

    def check(what: str, got: list[torch.Tensor], i: int, scale: float, ranks: list[int]
              ) -> None:
        total = sum(r + 1 for r in ranks)
        for j, tensor in enumerate(got):
            expected = torch.full((256 + 64 * j,), scale * total * (i + 1) + len(ranks) * j)
            if not torch.equal(tensor, expected):
                wrong.append(f"{what} round {i} tensor {j}: {tensor[:3].tolist()}, "
                             f"expected {expected[0].item()}")

    def in_set() -> None:
        for i in range(rounds):
            got = hvd.grouped_allreduce(inputs(i, 1.0), op=hvd.Sum, name=f"s.{i % 3}",
                                        process_set=pset)
            check("set", got, i, 1.0, [0, 1])

    thread = threading.Thread(target=in_set)
    if pset.included():
        thread.start()
    for i in range(rounds):
        got = hvd.grouped_allreduce(inputs(i, 1000.0), op=hvd.Sum, name=f"g.{i % 3}")
        check("global", got, i, 1000.0, [0, 1, 2])
    if pset.included():
        thread.join(120)
    alive = thread.is_alive()
    hvd.remove_process_set(pset)
    return {"alive": alive, "wrong": wrong[:5], "count": len(wrong)}
