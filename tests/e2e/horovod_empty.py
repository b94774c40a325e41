"""Horovod's collectives on tensors with no elements, a section of horovod_semantics.py.

Every dtype (the unsigned ones TensorFlow hands over included) through
every collective that takes it, on tensors with zero rows, zero trailing
extents, a rank that sends or contributes nothing, and the zero strides
numpy gives an empty TensorFlow tensor. Each call must give the right
(empty) result on every rank, and every later call must still work.
``horovod_semantics.py`` runs it in its ``main``; the multi-process tests
call :func:`empty_tensors` here at 2 and 3 ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from horovod_semantics import (  # noqa: E402 - the sibling section's helpers
    DTYPES,
    REDUCE_OPS,
    UNSIGNED,
    Checker,
    hvd,
    make_input,
    process_sets,
)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, zero_strides: bool) -> torch.Tensor:
    """An empty tensor, with the zero strides numpy gives an empty TF tensor if asked."""
    if zero_strides:
        return torch.empty_strided(shape, (0,) * len(shape), dtype=dtype)
    return torch.zeros(shape, dtype=dtype)


def empty_tensors() -> dict:
    rank = hvd.rank()
    c = Checker()
    for set_name, pset, ranks in process_sets():
        if rank not in ranks:
            continue
        n, me = len(ranks), ranks.index(rank)
        for dtype in DTYPES + UNSIGNED:
            for strided in (False, True):
                tag = f"{set_name}/{dtype}/{'zero strides' if strided else 'packed'}"
                # Every reduction once; Sum again for zero strides and in the set.
                ops = ("Sum",) if strided or set_name != "global" else ("Sum", "Min", "Product")
                _reductions(c, tag, dtype, strided, pset, n, me, ops)
                # allgather: zero-element rows everywhere; zero rows from the first rank.
                c.check(f"{tag} allgather (3, 0)",
                        hvd.allgather(_empty((3, 0), dtype, strided), process_set=pset),
                        torch.zeros((3 * n, 0), dtype=dtype))
                mine = (_empty((0, 2), dtype, strided) if me == 0
                        else make_input(rank, dtype, me, 2)[:, :2])
                # The first rank's rows are none (a set of one rank gathers nothing).
                want = torch.cat([make_input(r, dtype, i, 2)[:, :2]
                                  for i, r in enumerate(ranks)])
                c.check(f"{tag} allgather one rank none",
                        hvd.allgather(mine, process_set=pset), want)
                got = hvd.grouped_allgather([_empty((0,), dtype, strided), mine],
                                            process_set=pset)
                c.check(f"{tag} grouped_allgather empty", got[0], torch.zeros(0, dtype=dtype))
                c.check(f"{tag} grouped_allgather one rank none", got[1], want)
                # broadcast: nothing to send, in place or not.
                c.check(f"{tag} broadcast (3, 0)",
                        hvd.broadcast(_empty((3, 0), dtype, strided), ranks[-1],
                                      process_set=pset), torch.zeros((3, 0), dtype=dtype))
                y = _empty((0,), dtype, strided)
                c.check(f"{tag} broadcast_ (0,)",
                        hvd.broadcast_(y, ranks[0], process_set=pset), y)
                _alltoalls(c, tag, dtype, strided, pset, ranks, me)
    c.check("allreduce after", hvd.allreduce(torch.ones(3), op=hvd.Sum, name="empty.after"),
            torch.full((3,), float(hvd.size())))
    return c.report()


def _reductions(c: Checker, tag: str, dtype: torch.dtype, strided: bool, pset: object,
                n: int, me: int, ops: tuple[str, ...]) -> None:
    if dtype in UNSIGNED:
        return
    for oname in ops:
        op = REDUCE_OPS[oname]
        for shape in ((3, 0), (0,), (0, 2)):
            c.check(f"{tag} allreduce {oname} {shape}",
                    hvd.allreduce(_empty(shape, dtype, strided), op=op, process_set=pset),
                    torch.zeros(shape, dtype=dtype))
        y = _empty((2, 0), dtype, strided)
        c.check(f"{tag} allreduce_ {oname}", hvd.allreduce_(y, op=op, process_set=pset), y)
        # The same name again and again: negotiated once, then agreed on from the cache.
        for _ in range(3):
            c.check(f"{tag} cached allreduce {oname}",
                    hvd.allreduce(_empty((2, 0), dtype, strided), op=op, process_set=pset,
                                  name=f"empty.{tag}.{oname}"), torch.zeros((2, 0), dtype=dtype))
        got = hvd.grouped_allreduce([_empty((2, 0), dtype, strided), torch.ones(2, dtype=dtype)],
                                    op=op, process_set=pset)
        c.check(f"{tag} grouped_allreduce {oname} (2, 0)", got[0],
                torch.zeros((2, 0), dtype=dtype))
        got = hvd.grouped_allreduce([_empty((0,), dtype, strided), torch.ones(2, dtype=dtype)],
                                    op=op, process_set=pset)
        c.check(f"{tag} grouped_allreduce {oname} empty", got[0], torch.zeros(0, dtype=dtype))
        ones = torch.ones(2, dtype=dtype)
        c.check(f"{tag} grouped_allreduce {oname} beside it", got[1],
                ones * n if oname == "Sum" and dtype != torch.bool else ones)
        # No rows, no bytes in a row, and fewer rows than ranks (some ranks get none).
        for shape in ((0, 3), (n + 1, 0), (1, 2)):
            rows = shape[0] // n + (1 if me < shape[0] % n else 0)
            x = _empty(shape, dtype, strided) if 0 in shape else torch.ones(shape, dtype=dtype)
            want = torch.ones((rows, *shape[1:]), dtype=dtype)
            if oname == "Sum" and dtype != torch.bool:
                want = want * n
            c.check(f"{tag} reducescatter {oname} {shape}",
                    hvd.reducescatter(x, op=op, process_set=pset), want)


def _alltoalls(c: Checker, tag: str, dtype: torch.dtype, strided: bool, pset: object,
               ranks: list[int], me: int) -> None:
    n = len(ranks)
    # Nobody sends anything.
    out, received = hvd.alltoall(_empty((0, 3), dtype, strided), splits=[0] * n,
                                 process_set=pset)
    c.check(f"{tag} alltoall all empty", out, torch.zeros((0, 3), dtype=dtype))
    c.check(f"{tag} alltoall all empty received", received.long(), torch.zeros(n).long())
    # Zero-element rows: rows move, no bytes do.
    out = hvd.alltoall(_empty((2 * n, 0), dtype, strided), process_set=pset)
    c.check(f"{tag} alltoall (2n, 0)", out, torch.zeros((2 * n, 0), dtype=dtype))
    # The first rank sends nothing; every other rank sends one row to each rank.
    sends = {r: (make_input(r, dtype, n, 2) if i else _empty((0, 3), dtype, strided))
             for i, r in enumerate(ranks)}
    splits = [1] * n if me else [0] * n
    out, received = hvd.alltoall(sends[ranks[me]], splits=splits, process_set=pset)
    want = torch.cat([make_input(r, dtype, n, 2)[me:me + 1] if i
                      else torch.zeros((0, 3), dtype=dtype) for i, r in enumerate(ranks)])
    c.check(f"{tag} alltoall first rank sends none", out, want)
    c.check(f"{tag} alltoall first rank sends none received", received.long(),
            torch.tensor([0] + [1] * (n - 1)))
