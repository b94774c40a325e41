"""Horovod's semantics, the way Horovod's own test suite exercises them.

Run as a script under ``horovodrun -np 2`` (it imports ``horovod.torch``,
hora's shim), or call its sections from the multi-process tests (which run
it on ``hora.torch`` at 2 and 3 ranks). Each section returns a report that
the tests assert on; the script fails loudly on any wrong value.

Sections:
- :func:`dtype_matrix`: every dtype x every collective x dims 1-3 x the
  global set and a process set, against references every rank computes
  from every rank's (deterministic) input. The unsigned types torch has
  beyond uint8 (what TensorFlow hands over) go through every collective
  that only moves data.
- :func:`empty_tensors`: every dtype x every collective on tensors with no
  elements: zero rows, zero trailing extents, a rank sending or contributing
  nothing, and the zero strides numpy gives an empty TF tensor.
- :func:`gradients`: every differentiable collective, checked against
  Horovod's definitions of their gradients.
- :func:`invalid_calls`: every invalid call Horovod's docs and errors
  describe, each caught as a RuntimeError, each followed by a valid
  collective that must still work.
- :func:`train`: a model trained with DistributedOptimizer afterwards.
"""

from __future__ import annotations

import os
import sys

import torch

try:
    import horovod.torch as hvd  # under horovodrun: hora's shim
except ImportError:
    import hora.torch as hvd

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.bool]
# Unsigned types torch has beyond uint8 (TensorFlow hands them over); no
# reduction takes them (nor does Horovod's), every data-moving collective does.
UNSIGNED = [getattr(torch, name) for name in ("uint16", "uint32", "uint64")
            if hasattr(torch, name)]
REDUCE_OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max,
              "Product": hvd.Product}
TRAILING = {1: (), 2: (3,), 3: (3, 2)}


def make_input(rank: int, dtype: torch.dtype, rows: int, dim: int, salt: int = 0
               ) -> torch.Tensor:
    """Rank ``rank``'s input: small values (1-3), exact under every reduction here."""
    shape = (rows, *TRAILING[dim])
    n = 1
    for extent in shape:
        n *= extent
    values = (torch.arange(n, dtype=torch.int64) * 7 + rank * 5 + salt) % 3 + 1
    if dtype == torch.bool:
        return (values % 2 == 1).reshape(shape)
    return values.reshape(shape).to(dtype)


def reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    dtype = inputs[0].dtype
    stacked = torch.stack([t.to(torch.float64) for t in inputs])
    if op == "Sum":
        out = stacked.sum(0)
    elif op == "Average":
        out = stacked.sum(0) / len(inputs)
        if not dtype.is_floating_point:
            out = out.trunc()
    elif op == "Min":
        out = stacked.min(0).values
    elif op == "Max":
        out = stacked.max(0).values
    else:
        out = stacked.prod(0)
    if dtype == torch.bool:
        return out != 0 if op in ("Sum", "Max") else out.to(torch.bool)
    return out.to(dtype)


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if want.dtype in (torch.float16, torch.bfloat16):
        return torch.allclose(got.double(), want.double(), rtol=1e-2, atol=1e-2)
    return torch.equal(got, want)


def split_rows(rows: int, parts: int) -> list[int]:
    base, extra = divmod(rows, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


_SETS: list[tuple[str, object, list[int]]] = []


def process_sets() -> list[tuple[str, object, list[int]]]:
    """The global set, and a set of ranks {0, last}, added once (every rank must add it).

    At 2 ranks the set is {0}: Horovod refuses a second set with the same
    ranks, the global set's included.
    """
    if not _SETS:
        size = hvd.size()
        ranks = [0, size - 1] if size > 2 else [0]
        _SETS.extend([("global", hvd.global_process_set, list(range(size))),
                      ("set", hvd.add_process_set(ranks), ranks)])
    return _SETS


class Checker:
    def __init__(self) -> None:
        self.checks = 0
        self.failures: list[str] = []

    def check(self, what: str, got: object, want: torch.Tensor) -> None:
        self.checks += 1
        if not isinstance(got, torch.Tensor) or not same(got, want):
            self.failures.append(f"{what}: got {got!r:.200} want {want!r:.200}")

    def report(self) -> dict:
        return {"checks": self.checks, "failures": self.failures[:20],
                "failed": len(self.failures)}


# -- every dtype x every collective -----------------------------------------------


def dtype_matrix() -> dict:
    rank = hvd.rank()
    c = Checker()
    for set_name, pset, ranks in process_sets():
        if rank not in ranks:
            continue
        n, me = len(ranks), ranks.index(rank)
        for dtype, dim in ((d, k) for d in DTYPES + UNSIGNED for k in (1, 2, 3)):
            tag = f"{set_name}/{dtype}/{dim}d"
            xs = [make_input(r, dtype, 5, dim) for r in ranks]
            x = xs[me]
            for oname, op in REDUCE_OPS.items():
                if dtype in UNSIGNED or dtype == torch.bool and oname == "Average":
                    continue
                want = reference(xs, oname)
                c.check(f"{tag} allreduce {oname}", hvd.allreduce(x, op=op, process_set=pset),
                        want)
                y = x.clone()
                hvd.synchronize(hvd.allreduce_async_(y, op=op, process_set=pset))
                c.check(f"{tag} allreduce_async_ {oname}", y, want)
                got = hvd.grouped_allreduce([x, x.clone()], op=op, process_set=pset)
                c.check(f"{tag} grouped_allreduce {oname}", got[1], want)
                shares = split_rows(5, n)
                start = sum(shares[:me])
                c.check(f"{tag} reducescatter {oname}",
                        hvd.reducescatter(x, op=op, process_set=pset),
                        want[start:start + shares[me]])
                got = hvd.grouped_reducescatter([x, x], op=op, process_set=pset)
                c.check(f"{tag} grouped_reducescatter {oname}", got[1],
                        want[start:start + shares[me]])
            ragged = [make_input(r, dtype, r + 1, dim, salt=1) for r in ranks]
            want = torch.cat(ragged)
            c.check(f"{tag} allgather", hvd.allgather(ragged[me], process_set=pset), want)
            got = hvd.grouped_allgather([ragged[me], x], process_set=pset)
            c.check(f"{tag} grouped_allgather", got[0], want)
            c.check(f"{tag} grouped_allgather 2", got[1], torch.cat(xs))
            root = ranks[-1]
            c.check(f"{tag} broadcast", hvd.broadcast(x, root, process_set=pset), xs[-1])
            y = x.clone()
            hvd.broadcast_(y, root, process_set=pset)
            c.check(f"{tag} broadcast_", y, xs[-1])
            splits = {r: [(i + j) % 2 + 1 for j in range(n)] for i, r in enumerate(ranks)}
            sends = {r: make_input(r, dtype, sum(splits[r]), dim, salt=2) for r in ranks}
            pieces = []
            for r in ranks:
                offset = sum(splits[r][:me])
                pieces.append(sends[r][offset:offset + splits[r][me]])
            out, received = hvd.alltoall(sends[rank], splits=splits[rank], process_set=pset)
            c.check(f"{tag} alltoall", out, torch.cat(pieces))
            c.check(f"{tag} alltoall received", received.long(),
                    torch.tensor([splits[r][me] for r in ranks]))
            even = make_input(rank, dtype, 2 * n, dim, salt=3)
            c.check(f"{tag} alltoall even", hvd.alltoall(even, process_set=pset),
                    torch.cat([make_input(r, dtype, 2 * n, dim, salt=3)[2 * me:2 * me + 2]
                               for r in ranks]))
    # sparse_allreduce_async: every rank's entries, summed (or averaged) once coalesced.
    dense = [torch.zeros(6, 3) for _ in range(hvd.size())]
    for r, d in enumerate(dense):
        d[r] = r + 1.0
        d[5] = 2.0
    for oname, divisor in (("Sum", 1), ("Average", hvd.size())):
        got = hvd.synchronize(hvd.sparse_allreduce_async(dense[rank].to_sparse(), op=REDUCE_OPS[
            oname], name=f"sparse.{oname}"))
        c.check(f"sparse_allreduce {oname}", got.to_dense(), sum(dense) / divisor)
    return c.report()


# -- tensors made under torch.inference_mode() ---------------------------------


def inference_mode() -> dict:
    """Every collective on inference tensors (what Lightning's validation and
    test loops hand over), called inside ``torch.inference_mode()`` and outside
    it; plain calls work afterwards."""
    rank, size = hvd.rank(), hvd.size()
    c = Checker()
    for inside in (True, False):
        for dtype in (torch.float32, torch.int64):
            tag = f"{'inside' if inside else 'outside'}/{dtype}"
            with torch.inference_mode():
                xs = [make_input(r, dtype, 4, 2) for r in range(size)]
                ragged = [make_input(r, dtype, r + 1, 2, salt=1) for r in range(size)]
                y, z = xs[rank].clone(), xs[rank].clone()
            x = xs[rank]
            with torch.inference_mode(inside):
                for oname, op in REDUCE_OPS.items():
                    want = reference(xs, oname)
                    c.check(f"{tag} allreduce {oname}", hvd.allreduce(x, op=op), want)
                    c.check(f"{tag} grouped_allreduce {oname}",
                            hvd.grouped_allreduce([x, x], op=op)[1], want)
                    shares = split_rows(4, size)
                    start = sum(shares[:rank])
                    c.check(f"{tag} reducescatter {oname}", hvd.reducescatter(x, op=op),
                            want[start:start + shares[rank]])
                if dtype.is_floating_point:
                    c.check(f"{tag} allreduce scaled",
                            hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0,
                                          postscale_factor=0.5), reference(xs, "Sum"))
                hvd.allreduce_(y, op=hvd.Sum)
                c.check(f"{tag} allreduce_", y, reference(xs, "Sum"))
                c.check(f"{tag} allgather", hvd.allgather(ragged[rank]), torch.cat(ragged))
                c.check(f"{tag} broadcast", hvd.broadcast(x, size - 1), xs[-1])
                hvd.broadcast_(z, 0)
                c.check(f"{tag} broadcast_", z, xs[0])
                c.check(f"{tag} alltoall", hvd.alltoall(x.repeat(size, 1)),
                        torch.cat(xs))
                c.check(f"{tag} broadcast_object",
                        torch.tensor(hvd.broadcast_object(rank, 0)), torch.tensor(0))
    c.check("plain allreduce after", hvd.allreduce(torch.ones(3), op=hvd.Sum, name="plain"),
            torch.full((3,), float(size)))
    return c.report()


# -- gradients --------------------------------------------------------------------


def gradients() -> dict:
    """Each gradient against Horovod's definition, incoming gradient (rank + 1) everywhere."""
    rank = hvd.rank()
    c = Checker()
    f64 = torch.float64
    for set_name, pset, ranks in process_sets():
        if rank not in ranks:
            continue
        n, me = len(ranks), ranks.index(rank)
        g = {r: float(r + 1) for r in ranks}
        mean_g = sum(g.values()) / n
        for dim in (1, 2, 3):
            tag = f"{set_name}/{dim}d"
            for oname, pre, post in (("Sum", 1.0, 1.0), ("Average", 1.0, 1.0),
                                     ("Sum", 0.5, 3.0), ("Average", 2.0, 0.25)):
                op = REDUCE_OPS[oname]
                factor = pre * post
                total = sum(g.values()) if oname == "Sum" else mean_g
                x = make_input(rank, f64, 5, dim).requires_grad_()
                out = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post,
                                    process_set=pset)
                out.backward(torch.full_like(out, g[rank]))
                c.check(f"{tag} allreduce {oname} {pre}x{post}", x.grad,
                        torch.full_like(x, total * factor))
                a = make_input(rank, f64, 5, dim).requires_grad_()
                b = make_input(rank, f64, 2, dim).requires_grad_()
                outs = hvd.grouped_allreduce([a, b], op=op, prescale_factor=pre,
                                             postscale_factor=post, process_set=pset)
                c.check(f"{tag} grouped_allreduce has grad_fn",
                        torch.tensor(all(o.grad_fn is not None for o in outs)),
                        torch.tensor(True))
                sum(o.sum() for o in outs).mul(g[rank]).backward()
                c.check(f"{tag} grouped_allreduce {oname} grad", b.grad,
                        torch.full_like(b, total * factor))
                # reducescatter: allgather of the incoming gradients, x set size for
                # Sum, x prescale x postscale.
                shares = split_rows(5, n)
                want = torch.cat([torch.full((shares[i], *TRAILING[dim]), g[r], dtype=f64)
                                  for i, r in enumerate(ranks)])
                want = want * factor * (n if oname == "Sum" else 1)
                x = make_input(rank, f64, 5, dim).requires_grad_()
                out = hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post,
                                        process_set=pset)
                out.backward(torch.full_like(out, g[rank]))
                c.check(f"{tag} reducescatter {oname} {pre}x{post}", x.grad, want)
                x = make_input(rank, f64, 5, dim).requires_grad_()
                y = make_input(rank, f64, 3, dim).requires_grad_()
                outs = hvd.grouped_reducescatter([x, y], op=op, prescale_factor=pre,
                                                 postscale_factor=post, process_set=pset)
                (outs[0].sum() * g[rank] + outs[1].sum() * g[rank]).backward()
                c.check(f"{tag} grouped_reducescatter {oname}", x.grad, want)
            # broadcast: the average at the root, zeros elsewhere.
            root = ranks[-1]
            x = make_input(rank, f64, 4, dim).requires_grad_()
            out = hvd.broadcast(x, root, process_set=pset)
            out.backward(torch.full_like(out, g[rank]))
            c.check(f"{tag} broadcast", x.grad,
                    torch.full_like(x, mean_g if rank == root else 0.0))
            # allgather: the average of the incoming gradients, own rows.
            x = make_input(rank, f64, me + 1, dim).requires_grad_()
            out = hvd.allgather(x, process_set=pset)
            incoming = torch.arange(out.shape[0], dtype=f64).reshape(-1, *[1] * (dim - 1))
            incoming = (incoming + 1) * g[rank] * torch.ones_like(out)
            out.backward(incoming)
            offset = sum(range(1, me + 1))
            rows = torch.arange(offset, offset + me + 1, dtype=f64).reshape(-1, *[1] * (dim - 1))
            c.check(f"{tag} allgather", x.grad, (rows + 1) * mean_g * torch.ones_like(x))
            a = make_input(rank, f64, me + 1, dim).requires_grad_()
            b = make_input(rank, f64, 2, dim).requires_grad_()
            outs = hvd.grouped_allgather([a, b], process_set=pset)
            (outs[0].sum() + outs[1].sum()).mul(g[rank]).backward()
            c.check(f"{tag} grouped_allgather", b.grad, torch.full_like(b, mean_g))
            # alltoall: each row's gradient comes back from the rank it went to.
            splits = [1] * n
            x = make_input(rank, f64, n, dim).requires_grad_()
            out, _received = hvd.alltoall(x, splits=splits, process_set=pset)
            out.backward(torch.full_like(out, g[rank]))
            want = torch.cat([torch.full((1, *TRAILING[dim]), g[r], dtype=f64) for r in ranks])
            c.check(f"{tag} alltoall", x.grad, want.reshape(x.shape))
    return c.report()


# -- invalid calls, each followed by a valid one ------------------------------------


def _invalid_cases(rank: int, size: int, pset: object) -> list[tuple[str, object]]:
    f = torch.ones(4)
    last = size - 1
    return [
        ("allreduce shapes differ", lambda: hvd.allreduce(torch.ones(rank + 2), name="v.shape")),
        ("allreduce dtypes differ", lambda: hvd.allreduce(
            torch.ones(2, dtype=torch.float32 if rank else torch.float64), name="v.dtype")),
        ("allreduce ops differ", lambda: hvd.allreduce(
            f, op=hvd.Sum if rank else hvd.Max, name="v.op")),
        ("allreduce scale factors differ", lambda: hvd.allreduce(
            f, prescale_factor=1.0 + rank, name="v.scale")),
        ("allreduce unknown op", lambda: hvd.allreduce(f, op=42)),
        ("allreduce op and average", lambda: hvd.allreduce(f, average=True, op=hvd.Sum)),
        ("allreduce of a complex tensor", lambda: hvd.allreduce(
            torch.ones(2, dtype=torch.complex64))),
        ("allreduce Average of bool", lambda: hvd.allreduce(torch.ones(2, dtype=torch.bool))),
        ("allreduce Adasum of ints", lambda: hvd.allreduce(
            torch.ones(2, dtype=torch.int32), op=hvd.Adasum)),
        ("allreduce of a list", lambda: hvd.allreduce([1.0, 2.0])),
        *[(f"allreduce of {t}", lambda t=t: hvd.allreduce(torch.ones(2, dtype=t)))
          for t in UNSIGNED],
        ("reducescatter of an unsigned tensor", lambda: hvd.reducescatter(
            torch.ones(size, dtype=UNSIGNED[0] if UNSIGNED else torch.complex64))),
        ("allreduce of a sparse tensor", lambda: hvd.allreduce(torch.eye(2).to_sparse())),
        ("allreduce invalid on one rank", lambda: hvd.allreduce(
            torch.ones(2, dtype=torch.complex64 if rank == last else torch.float32),
            name="v.onerank")),
        # The name was negotiated and cached before (see invalid_calls): the valid
        # ranks would agree on it peer to peer, so the invalid rank must drop it.
        ("cached allreduce invalid on one rank", lambda: hvd.allreduce(
            f, op=42 if rank == last else hvd.Sum, name="v.cached")),
        ("duplicate in-flight name", lambda: [hvd.allreduce_async(f, name="v.dup"),
                                              hvd.allreduce_async(f, name="v.dup")]),
        ("grouped_allreduce Adasum", lambda: hvd.grouped_allreduce([f, f], op=hvd.Adasum)),
        ("grouped_allreduce empty", lambda: hvd.grouped_allreduce([])),
        ("grouped_allreduce shapes differ", lambda: hvd.grouped_allreduce(
            [f, torch.ones(rank + 1)], name="v.group")),
        ("allgather trailing dims differ", lambda: hvd.allgather(
            torch.ones(2, rank + 1), name="v.gather")),
        ("allgather ranks differ in dims", lambda: hvd.allgather(
            torch.ones(2, 2) if rank else torch.ones(2), name="v.gatherdims")),
        ("allgather dtypes differ", lambda: hvd.allgather(
            torch.ones(2, dtype=torch.int32 if rank else torch.int64), name="v.gatherdtype")),
        ("broadcast root ranks differ", lambda: hvd.broadcast(f, rank, name="v.root")),
        ("broadcast root out of range", lambda: hvd.broadcast(f, size)),
        ("broadcast root out of range on one rank", lambda: hvd.broadcast(
            f, size + 3 if rank == 0 else 0, name="v.rootone")),
        ("broadcast shapes differ", lambda: hvd.broadcast(torch.ones(rank + 1), 0,
                                                          name="v.bshape")),
        # With 3 ranks the set is {0, 2}: its members name a root outside it, and
        # rank 1 is refused for running a collective on a set it is not in.
        ("broadcast root not in set", lambda: hvd.broadcast(
            f, 1 if size > 2 else size + 1, process_set=pset)),
        ("alltoall splits of wrong length", lambda: hvd.alltoall(f, splits=[4] + [0] * size)),
        ("alltoall splits do not sum", lambda: hvd.alltoall(f, splits=[1] * size)),
        ("alltoall float splits", lambda: hvd.alltoall(
            torch.ones(size), splits=torch.ones(size))),
        ("alltoall not divisible", lambda: hvd.alltoall(torch.ones(size + 1))),
        ("alltoall 0-d", lambda: hvd.alltoall(torch.tensor(1.0))),
        ("alltoall trailing dims differ", lambda: hvd.alltoall(
            torch.ones(size, rank + 1), name="v.a2a")),
        ("reducescatter 0-d", lambda: hvd.reducescatter(torch.tensor(1.0))),
        ("reducescatter Adasum", lambda: hvd.reducescatter(f, op=hvd.Adasum)),
        ("reducescatter shapes differ", lambda: hvd.reducescatter(
            torch.ones(rank + 4), name="v.rs")),
        ("grouped_reducescatter 0-d", lambda: hvd.grouped_reducescatter(
            [f, torch.tensor(1.0)])),
        ("collective on a set never added", lambda: hvd.allreduce(
            f, process_set=hvd.ProcessSet([0]))),
        ("poll of an unknown handle (synchronize returns None)", lambda: hvd.poll(987654321)),
        ("sparse_allreduce of a dense tensor", lambda: hvd.sparse_allreduce_async(f)),
    ]


def invalid_calls() -> dict:
    """Each invalid call raises a RuntimeError on every rank, and the next call works."""
    rank, size = hvd.rank(), hvd.size()
    pset = process_sets()[1][1]
    for _ in range(3):
        hvd.allreduce(torch.ones(4), op=hvd.Sum, name="v.cached")
    results = []
    for i, (what, call) in enumerate(_invalid_cases(rank, size, pset)):
        try:
            call()
            raised = None
        except RuntimeError as exc:
            raised = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - reported as not a RuntimeError
            raised = f"NOT A RuntimeError {type(exc).__name__}: {exc}"
        after = hvd.allreduce(torch.full((3,), float(rank + i)), op=hvd.Sum,
                              name=f"after.{i}")
        want = float(sum(range(size)) + size * i)
        results.append({"call": what, "raised": raised,
                        "next_ok": bool(torch.equal(after, torch.full((3,), want)))})
    # Leftovers of the duplicate-name case finish, then every kind of collective works.
    hvd.barrier()
    ok = bool(torch.equal(hvd.allgather(torch.tensor([rank])), torch.arange(size))
              and torch.equal(hvd.broadcast(torch.tensor([rank]), 0), torch.tensor([0])))
    return {"results": results, "collectives_ok_after": ok}


# -- training ---------------------------------------------------------------------


def train(steps: int = 30) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    data = torch.randn(64, 8, generator=gen)
    target = (data[:, 0] + data[:, 1] > 0).long()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        losses.append(float(hvd.allreduce(loss.detach(), name="loss")))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0))
    return {"first_loss": losses[0], "last_loss": losses[-1],
            "identical": bool(all(torch.equal(gathered[0], row) for row in gathered))}


def main() -> int:
    hvd.init()
    rank = hvd.rank()
    problems = []
    matrix = dtype_matrix()
    if matrix["failed"]:
        problems.append(f"dtype matrix: {matrix['failures']}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    # Run as a script this module is __main__: horovod_empty must share its process sets
    # (a second import would add the same set again, which Horovod refuses).
    sys.modules.setdefault("horovod_semantics", sys.modules[__name__])
    from horovod_empty import empty_tensors  # a section of its own (this file's length)

    empty = empty_tensors()
    if empty["failed"]:
        problems.append(f"empty tensors: {empty['failures']}")
    grads = gradients()
    if grads["failed"]:
        problems.append(f"gradients: {grads['failures']}")
    inference = inference_mode()
    if inference["failed"]:
        problems.append(f"inference mode: {inference['failures']}")
    invalid = invalid_calls()
    for item in invalid["results"]:
        if item["raised"] is None or item["raised"].startswith("NOT") or not item["next_ok"]:
            problems.append(f"invalid call {item}")
    if not invalid["collectives_ok_after"]:
        problems.append("collectives failed after the invalid calls")
    trained = train()
    if not (trained["identical"] and trained["last_loss"] < trained["first_loss"]):
        problems.append(f"training: {trained}")
    if rank == 0:
        print(f"dtype matrix: {matrix['checks']} checks; empty tensors: {empty['checks']} "
              f"checks; gradients: {grads['checks']} checks; "
              f"invalid calls: {len(invalid['results'])} caught; training loss "
              f"{trained['first_loss']:.4f} -> {trained['last_loss']:.4f}", flush=True)
    for problem in problems:
        print(f"rank {rank}: {problem}", file=sys.stderr, flush=True)
    hvd.shutdown()
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
