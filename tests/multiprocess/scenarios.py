"""Functions that run inside worker processes (see tests/support/workers.py).

Inputs are built by ``make_input`` from (rank, dtype, shape), so the test
process can rebuild every rank's input and compute the single-process
reference. Values are small integers, so that sums and products are exact
even in float16 and bfloat16.
"""

from __future__ import annotations

import os
import time

import torch

import hora.torch as hvd

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
OPS = ["Average", "Sum", "Min", "Max", "Product"]


def make_input(rank: int, dtype: torch.dtype, shape: tuple[int, ...], salt: int = 0
               ) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    values = (torch.arange(n, dtype=torch.int64) * 7 + rank * 5 + salt) % 3 + 1
    return values.reshape(shape).to(dtype)


def world_info():
    return {
        "size": hvd.size(), "rank": hvd.rank(), "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(), "is_homogeneous": hvd.is_homogeneous(),
        "is_initialized": hvd.is_initialized(), "gloo_built": hvd.gloo_built(),
        "nccl_built": hvd.nccl_built(), "mpi_built": hvd.mpi_built(),
        "ccl_built": hvd.ccl_built(),
    }


def allreduce_matrix(dtype_names, op_names):
    """Every allreduce flavour for every (dtype, op); returns {key: tensor}."""
    rank = hvd.rank()
    out = {}
    for dname in dtype_names:
        dtype = DTYPES[dname]
        for oname in op_names:
            op = getattr(hvd, oname)
            x = make_input(rank, dtype, (3, 4))
            out[(dname, oname, "allreduce")] = hvd.allreduce(x, name=f"a.{dname}.{oname}", op=op)
            y = x.clone()
            hvd.allreduce_(y, name=f"b.{dname}.{oname}", op=op)
            out[(dname, oname, "allreduce_")] = y
            h1 = hvd.allreduce_async(x, name=f"c.{dname}.{oname}", op=op)
            z = x.clone()
            h2 = hvd.allreduce_async_(z, name=f"d.{dname}.{oname}", op=op)
            out[(dname, oname, "allreduce_async")] = hvd.synchronize(h1)
            hvd.synchronize(h2)
            out[(dname, oname, "allreduce_async_")] = z
            assert torch.equal(x, make_input(rank, dtype, (3, 4))), "input was modified"
    return out


def allreduce_scaled(dtype_names):
    rank = hvd.rank()
    out = {}
    for dname in dtype_names:
        x = make_input(rank, DTYPES[dname], (5,))
        for oname in ("Sum", "Average"):
            out[(dname, oname)] = hvd.allreduce(
                x, name=f"s.{dname}.{oname}", op=getattr(hvd, oname), prescale_factor=0.5,
                postscale_factor=4.0)
    return out


def allreduce_unnamed_and_noncontiguous():
    rank = hvd.rank()
    base = make_input(rank, torch.float32, (4, 6))
    t = base.t()  # not contiguous
    r1 = hvd.allreduce(t, op=hvd.Sum)
    t2 = base.t().clone().t()  # contiguous copy of base laid out transposed
    hvd.allreduce_(base.t(), op=hvd.Sum)  # in place on a view: writes back into base
    r3 = hvd.allreduce(torch.tensor(float(rank)), op=hvd.Sum)  # a 0-dim tensor
    return {"r1": r1, "base_after": base, "t2": t2, "scalar": r3}


def grouped(dtype_name):
    rank = hvd.rank()
    dtype = DTYPES[dtype_name]
    tensors = [make_input(rank, dtype, s, salt=i) for i, s in enumerate([(3,), (2, 2), (5, 1)])]
    sync = hvd.grouped_allreduce(tensors, name="grp", op=hvd.Sum)
    inplace = [t.clone() for t in tensors]
    hvd.grouped_allreduce_(inplace, name="grp2", op=hvd.Sum)
    handle = hvd.grouped_allreduce_async(tensors, name="grp3", op=hvd.Average)
    avg = hvd.synchronize(handle)
    return {"sum": sync, "inplace": inplace, "avg": avg}


def allgather_ragged(dtype_names):
    rank = hvd.rank()
    out = {}
    for dname in dtype_names:
        x = make_input(rank, DTYPES[dname], (rank + 1, 3))
        out[(dname, "sync")] = hvd.allgather(x, name=f"g.{dname}")
        out[(dname, "async")] = hvd.synchronize(hvd.allgather_async(x, name=f"ga.{dname}"))
    out["empty_on_rank0"] = hvd.allgather(torch.full((rank, 2), float(rank)), name="g.empty")
    out["1d"] = hvd.allgather(torch.arange(rank + 2, dtype=torch.int64), name="g.1d")
    return out


def broadcasts(dtype_names):
    rank, size = hvd.rank(), hvd.size()
    out = {}
    for dname in dtype_names:
        for root in sorted({0, size - 1}):
            x = make_input(rank, DTYPES[dname], (2, 3))
            out[(dname, root, "broadcast")] = hvd.broadcast(x, root, name=f"bc.{dname}.{root}")
            y = x.clone()
            hvd.broadcast_(y, root, name=f"bc_.{dname}.{root}")
            out[(dname, root, "broadcast_")] = y
            z = x.clone()
            hvd.synchronize(hvd.broadcast_async_(z, root, name=f"bca_.{dname}.{root}"))
            out[(dname, root, "broadcast_async_")] = z
            out[(dname, root, "broadcast_async")] = hvd.synchronize(
                hvd.broadcast_async(x, root, name=f"bca.{dname}.{root}"))
    return out


def alltoalls(dtype_names):
    rank, size = hvd.rank(), hvd.size()
    out = {}
    for dname in dtype_names:
        x = make_input(rank, DTYPES[dname], (2 * size, 3)) + rank * 10
        out[(dname, "even")] = hvd.alltoall(x, name=f"at.{dname}")
        splits = [(rank + s) % 3 for s in range(size)]
        y = make_input(rank, DTYPES[dname], (sum(splits), 2))
        result, received = hvd.alltoall(y, splits=splits, name=f"ats.{dname}")
        out[(dname, "splits")] = (result, received)
        out[(dname, "splits_tensor")] = hvd.alltoall(
            y, splits=torch.tensor(splits), name=f"att.{dname}")[0]
        h = hvd.alltoall_async(x, name=f"ata.{dname}")
        out[(dname, "async")] = hvd.synchronize(h)[0]
    return out


def reducescatters(dtype_names, op_names):
    rank, size = hvd.rank(), hvd.size()
    out = {}
    for dname in dtype_names:
        for oname in op_names:
            for rows in (2 * size, 2 * size + 1):
                x = make_input(rank, DTYPES[dname], (rows, 2))
                out[(dname, oname, rows)] = hvd.reducescatter(
                    x, name=f"rs.{dname}.{oname}.{rows}", op=getattr(hvd, oname))
    return out


def barrier_poll_synchronize():
    rank = hvd.rank()
    if rank == 0:
        time.sleep(0.5)
    t0 = time.monotonic()
    hvd.barrier()
    waited = time.monotonic() - t0
    x = torch.ones(1000) * rank
    handle = hvd.allreduce_async(x, name="polled", op=hvd.Sum)
    polls = 0
    while not hvd.poll(handle):
        polls += 1
        time.sleep(0.001)
    result = hvd.synchronize(handle)
    return {"waited": waited, "result": result, "polls": polls}


def differentiable():
    rank = hvd.rank()
    x = torch.full((2, 2), float(rank + 1), requires_grad=True)
    y = hvd.allreduce(x, name="ad.allreduce", op=hvd.Sum)
    y.sum().backward()
    g_allreduce = x.grad.clone()
    x.grad = None
    z = hvd.allgather(x, name="ad.allgather")
    (z * (torch.arange(z.shape[0]).reshape(-1, 1) + 1)).sum().backward()
    g_allgather = x.grad.clone()
    x.grad = None
    b = hvd.broadcast(x, 0, name="ad.broadcast")
    b.sum().backward()
    return {"allreduce": g_allreduce, "allgather": g_allgather, "broadcast": x.grad.clone()}


def objects_and_state():
    rank = hvd.rank()
    obj = {"rank": rank, "payload": list(range(rank + 3))}
    bcast = hvd.broadcast_object(obj if rank == 0 else None, root_rank=0)
    gathered = hvd.allgather_object(obj)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    torch.manual_seed(100 + rank)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    states = {}
    for name, make in (
            ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1 * (rank + 1), momentum=0.9)),
            ("adam", lambda ps: torch.optim.Adam(ps, lr=0.01 * (rank + 1)))):
        opt = make(model.parameters())
        # Give every rank different optimizer state before the broadcast.
        for _ in range(rank + 1):
            opt.zero_grad()
            model(torch.randn(5, 4)).sum().backward()
            opt.step()
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        states[name] = opt.state_dict()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    named = list(model.named_parameters())
    hvd.broadcast_parameters(named, root_rank=0)
    return {"bcast": bcast, "gathered": gathered, "params": model.state_dict(), "opt": states}


def train_steps(compression: str, backward_passes: int, steps: int, opt_name: str = "sgd"):
    """Trains a tiny model on shards of a fixed batch; returns the final parameters."""
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(),
        compression=getattr(hvd.Compression, compression),
        backward_passes_per_step=backward_passes)
    gen = torch.Generator().manual_seed(1234)
    data = torch.randn(steps, backward_passes, 4 * size, 6, generator=gen)
    target = torch.randint(0, 3, (steps, backward_passes, 4 * size), generator=gen)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(backward_passes):
            x = data[step, micro, rank * 4:(rank + 1) * 4]
            y = target[step, micro, rank * 4:(rank + 1) * 4]
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- error paths ------------------------------------------------------------


def mismatch(kind: str):
    rank = hvd.rank()
    if kind == "dtype":
        x = torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64)
        hvd.allreduce(x, name="bad.dtype")
    elif kind == "shape":
        hvd.allreduce(torch.ones(4 + rank), name="bad.shape")
    elif kind == "op":
        hvd.allreduce(torch.ones(4), name="bad.op", op=hvd.Sum if rank == 0 else hvd.Max)
    elif kind == "root":
        hvd.broadcast(torch.ones(4), root_rank=rank, name="bad.root")
    elif kind == "allgather_dims":
        hvd.allgather(torch.ones(2, 3 + rank), name="bad.allgather")
    return "no error"


def after_mismatch_still_works():
    """A mismatch fails that tensor, not the job: the next collective works."""
    rank = hvd.rank()
    try:
        hvd.allreduce(torch.ones(2 + rank), name="bad.then.good")
    except hvd.HorovodInternalError as exc:
        first = type(exc).__name__
    else:
        first = "no error"
    return first, hvd.allreduce(torch.ones(3), name="good", op=hvd.Sum)


def duplicate_name():
    x = torch.ones(10)
    if hvd.rank() != 0:
        # Keeps rank 0's first "dup" in flight while it submits the second.
        time.sleep(1.0)
    handle = hvd.allreduce_async(x, name="dup")
    try:
        hvd.allreduce_async(x, name="dup")
    except ValueError as exc:
        message = str(exc)
    else:
        message = None
    hvd.synchronize(handle)
    return message


def die_mid_training(victim: int, steps_before: int):
    """Rank ``victim`` kills itself after some steps; the others keep allreducing."""
    rank = hvd.rank()
    x = torch.ones(1000)
    for step in range(100000):
        if rank == victim and step == steps_before:
            os.kill(os.getpid(), 9)
        hvd.allreduce(x, name=f"step.{step}")
    return "unreachable"


def stall(wait_s: float):
    """Rank 0 submits a tensor the others submit only after ``wait_s`` seconds."""
    if hvd.rank() != 0:
        time.sleep(wait_s)
    return hvd.allreduce(torch.ones(2), name="slowpoke", op=hvd.Sum)


def stall_cached(wait_s: float):
    """Like :func:`stall`, for a tensor the ranks already agreed on once (cached)."""
    hvd.allreduce(torch.ones(2), name="slowpoke", op=hvd.Sum)
    if hvd.rank() != 0:
        time.sleep(wait_s)
    return hvd.allreduce(torch.ones(2), name="slowpoke", op=hvd.Sum)


def init_only():
    import hora.torch as hvd_mod

    hvd_mod.init()
    return hvd_mod.size()


def shutdown_and_init_again():
    first = hvd.allreduce(torch.ones(2), name="before", op=hvd.Sum)
    hvd.shutdown()
    assert not hvd.is_initialized()
    hvd.init()
    second = hvd.allreduce(torch.ones(2) * 2, name="before", op=hvd.Sum)
    return first, second, hvd.rank(), hvd.size()


def use_before_init():
    hvd.shutdown()
    try:
        hvd.rank()
    except ValueError as exc:
        return str(exc)
    return None


# -- process sets and join -------------------------------------------------------


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


# -- DistributedOptimizer variants -------------------------------------------------


class EmbeddingNet(torch.nn.Module):
    def __init__(self, sparse: bool):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 4, sparse=sparse)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, idx):
        return self.fc(self.emb(idx).mean(1))


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
    model = EmbeddingNet(sparse=sparse)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    kwargs = {"named_parameters": model.named_parameters()}
    if variant == "groups":
        kwargs["groups"] = 2
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


# -- response cache ------------------------------------------------------------------


def _negotiation_messages(http_url: str, job_id: str) -> int:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{http_url}/api/v1/jobs/{job_id}", timeout=10) as reply:
        return json.load(reply)["negotiation_messages"]


def steady_state_messages(http_url: str, job_id: str, steps: int):
    """Coordinator messages during `steps` training steps after warm-up."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.randn(4, 8)

    def step():
        opt.zero_grad()
        model(data).pow(2).mean().backward()
        opt.step()

    def step_with_metric():
        step()
        hvd.allreduce(torch.tensor(1.0), name="metric.loss")  # a metric, every step

    for _ in range(3):
        step_with_metric()
    hvd.barrier()
    before = _negotiation_messages(http_url, job_id)
    for _ in range(steps):
        step_with_metric()
    hvd.barrier()
    after = _negotiation_messages(http_url, job_id)
    # A cached allreduce (no coordinator message) holds the other ranks until
    # rank 0 has read the counter: their next barrier must not race the read.
    hvd.allreduce(torch.tensor(1.0), name="metric.loss")
    hvd.barrier()
    idle = _negotiation_messages(http_url, job_id)
    # (after - before) is the steps plus one barrier; (idle - after) is one barrier.
    return before, after, idle


def cache_invalidation():
    rank = hvd.rank()
    out = {}
    for i in range(3):
        out[f"same.{i}"] = hvd.allreduce(torch.ones(4), name="x", op=hvd.Sum)
    # Every rank changes the shape of a cached name: renegotiated, still right.
    out["grown"] = hvd.allreduce(torch.ones(6), name="x", op=hvd.Sum)
    out["grown.again"] = hvd.allreduce(torch.ones(6), name="x", op=hvd.Sum)
    # Only rank 0 changes the dtype of a cached name: a mismatch error, not a hang.
    x = torch.ones(6, dtype=torch.float64 if rank == 0 else torch.float32)
    try:
        hvd.allreduce(x, name="x", op=hvd.Sum)
    except hvd.HorovodInternalError as exc:
        out["mismatch"] = (type(exc).__name__, str(exc))
    out["after"] = hvd.allreduce(torch.ones(2), name="x", op=hvd.Sum)
    return out


def fusion_mix(rounds: int = 3):
    """Many async allreduces of mixed dtypes and sizes, some above the fusion threshold."""
    rank = hvd.rank()
    specs = [(torch.float32, 10), (torch.float64, 7), (torch.float32, 3000), (torch.int64, 5),
             (torch.float32, 1), (torch.float16, 64), (torch.float64, 900), (torch.int32, 33)]
    results = []
    for _ in range(rounds):  # round 0 negotiates, later rounds come from the cache
        handles = []
        for i, (dtype, n) in enumerate(specs):
            x = make_input(rank, dtype, (n,), salt=i)
            handles.append(hvd.allreduce_async(x, name=f"fuse.{i}", op=hvd.Sum))
        results.append([hvd.synchronize(h) for h in handles])
    return results, [(str(d), n) for d, n in specs]


def mesh_steps(dtype_names, op_names, steps):
    """Cached allreduces enqueued in a different order on odd ranks, so that rounds
    see different ready sets; returns each step's results, the mesh's batch count and
    the pairwise allreduce's count."""
    from hora import _runtime

    rank = hvd.rank()
    keys = [(d, o, False) for d in dtype_names for o in op_names]
    keys += [(d, o, True) for d in dtype_names if DTYPES[d].is_floating_point
             for o in ("Sum", "Average")]
    order = keys if rank % 2 == 0 else keys[::-1]
    steps_out = []
    for step in range(steps):
        handles = {}
        for i, (dname, oname, scaled) in enumerate(order):
            x = make_input(rank, DTYPES[dname], (5, 3), salt=step)
            scale = {"prescale_factor": 0.5, "postscale_factor": 2.0} if scaled else {}
            handles[(dname, oname, scaled)] = hvd.allreduce_async(
                x, name=f"mesh.{dname}.{oname}.{scaled}", op=getattr(hvd, oname), **scale)
            if rank == 1 and i % 5 == 0:
                time.sleep(0.002)
        steps_out.append({key: hvd.synchronize(h) for key, h in handles.items()})
    engine = _runtime.current().engine
    return steps_out, engine.mesh_batches, engine.pairwise_allreduces


def mesh_gaps(steps):
    """Rank 1 submits every other tensor first, so rank 0's payload holds tensors the
    round does not agree on between ones it does."""
    rank = hvd.rank()
    out = []
    for step in range(steps):
        xs = [make_input(rank, torch.float32, (7,), salt=step + i) for i in range(6)]
        # Step 0 negotiates, giving the names cache slots in name order.
        gaps = rank == 1 and step > 0
        order = [0, 2, 4, 1, 3, 5] if gaps else list(range(6))
        handles = {}
        for i in order:
            handles[i] = hvd.allreduce_async(xs[i], name=f"gap.{i}", op=hvd.Sum)
            if gaps and i == 4:
                time.sleep(0.05)
        out.append([hvd.synchronize(handles[i]) for i in range(6)])
    return out


def timeline_run(path_at_start: str, path_later: str):
    rank = hvd.rank()
    for _ in range(3):
        handles = [hvd.allreduce_async(torch.ones(100) * rank, name=f"grad.{i}")
                   for i in range(4)]
        for h in handles:
            hvd.synchronize(h)
    # A group is fused by the coordinator every time: the fusion-buffer events.
    hvd.grouped_allreduce([torch.ones(5), torch.ones(7)], name="group")
    hvd.broadcast(torch.ones(3), root_rank=0, name="bcast")
    hvd.stop_timeline()
    hvd.start_timeline(path_later, mark_cycles=False)
    hvd.allreduce(torch.ones(2), name="later")
    hvd.stop_timeline()
    return True


def train_for(seconds: float):
    """A small DistributedOptimizer loop for a fixed time (used with --autotune)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.randn(32, 64)
    deadline = time.monotonic() + seconds
    steps = 0
    while True:
        opt.zero_grad()
        model(data).pow(2).mean().backward()
        opt.step()
        steps += 1
        # Every rank stops at the same step: rank 0's clock decides.
        if hvd.broadcast_object(time.monotonic() > deadline, root_rank=0, name=f"stop.{steps}"):
            break
    return steps


def elastic_mismatch():
    """A mismatch inside hvd.elastic.run is the script's bug: raised at once, no reset."""
    rank = hvd.rank()
    entries = []
    state = hvd.elastic.ObjectState(epoch=0)

    @hvd.elastic.run
    def train(state):
        entries.append(hvd.size())
        hvd.allreduce(torch.ones(2 + rank), name="elastic.bad.shape")

    try:
        train(state)
    except hvd.HorovodInternalError as exc:
        error = type(exc).__name__
    else:
        error = None
    return error, entries, hvd.allreduce(torch.ones(3), name="elastic.good", op=hvd.Sum)
