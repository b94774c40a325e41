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


def grouped_mixed_dtypes():
    """A group whose tensors differ in dtype (Horovod takes it): float32, float64,
    int32, an empty float16 and float32 again, synchronous, in place and async;
    then a plain allreduce, which must still work."""
    rank = hvd.rank()
    specs = [(torch.float32, (3,)), (torch.float64, (2, 2)), (torch.int32, (4,)),
             (torch.float16, (0, 2)), (torch.float32, (1,))]
    tensors = [make_input(rank, dtype, shape, salt=i) for i, (dtype, shape) in enumerate(specs)]
    sync = hvd.grouped_allreduce(tensors, name="mixed", op=hvd.Sum)
    inplace = [t.clone() for t in tensors]
    hvd.grouped_allreduce_(inplace, name="mixed2", op=hvd.Max)
    avg = hvd.synchronize(hvd.grouped_allreduce_async(
        [t for t in tensors if t.is_floating_point()], name="mixed3", op=hvd.Average))
    after = hvd.allreduce(torch.ones(2), name="mixed.after", op=hvd.Sum)
    return {"sum": sync, "max": inplace, "avg": avg, "after": after}


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
    # Horovod's synchronize returns None for a handle synchronized already, or
    # never made; its poll raises ValueError for one.
    again, bogus = hvd.synchronize(handle), hvd.synchronize(123456789)
    try:
        hvd.poll(handle)
        polled_again = "no error"
    except ValueError as exc:
        polled_again = type(exc).__name__
    return {"waited": waited, "result": result, "polls": polls, "again": again,
            "bogus": bogus, "polled_again": polled_again,
            "after": hvd.allreduce(torch.ones(2), name="after.handles", op=hvd.Sum)}


def waited_then_polled(rounds: int = 20):
    """Waited allreduces (their callers run the rounds) mixed with async ones that
    are only polled, from this thread and from a second one: nobody waits on
    the polled ones, so the background thread must still run their rounds."""
    import threading

    rank = hvd.rank()

    def poll_until_done(handle, what):
        deadline = time.monotonic() + 20
        while not hvd.poll(handle):
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: no round ran for a polled allreduce")
            time.sleep(0.001)
        return hvd.synchronize(handle)

    out = {"waited": [], "polled": [], "threaded": []}
    for i in range(rounds):
        out["waited"].append(hvd.allreduce(torch.full((4,), float(rank + i)),
                                           name=f"waited.{i}", op=hvd.Sum))
        handle = hvd.allreduce_async(torch.full((4,), float(rank * i)), name=f"polled.{i}",
                                     op=hvd.Sum)
        out["polled"].append(poll_until_done(handle, f"polled.{i}"))
    # A second thread's polled allreduce goes in while this thread's waited
    # one is in flight (admitted first, it wakes nobody).
    errors = []

    def second():
        try:
            for i in range(rounds):
                handle = hvd.allreduce_async(torch.full((3,), float(rank + 10 * i)),
                                             name=f"threaded.{i}", op=hvd.Sum)
                out["threaded"].append(poll_until_done(handle, f"threaded.{i}"))
        except BaseException as exc:  # reported by the main thread
            errors.append(repr(exc))

    thread = threading.Thread(target=second)
    thread.start()
    for i in range(rounds):
        hvd.allreduce_(torch.full((2,), float(i)), name=f"alongside.{i}", op=hvd.Sum)
    thread.join(60)
    assert not thread.is_alive() and not errors, errors
    return out


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
