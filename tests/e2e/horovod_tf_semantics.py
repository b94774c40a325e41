"""Horovod's TensorFlow semantics, as a Horovod user's script exercises them.

Run under ``horovodrun -np N`` (it imports ``horovod.tensorflow``, hora's
shim). Every rank computes every reference from every rank's deterministic
input; the script fails loudly on any wrong value.

Sections:
- :func:`dtype_matrix`: every TF collective x every dtype x dims 1-3 x the
  global set and a process set, empty tensors too, in eager mode, inside
  ``tf.function`` and in a ``tf.compat.v1`` Session graph holding every
  call of one dtype as independent collectives;
- :func:`gradients`: every differentiable collective against Horovod's
  definitions, eager (GradientTape) and in a Session graph (tf.gradients);
- :func:`invalid_calls`: every invalid call, each caught as the TF class
  Horovod raises, each followed by a valid call that must still work;
- barrier and join.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

try:
    import horovod.tensorflow as hvd  # under horovodrun: hora's shim
except ImportError:
    import hora.tensorflow as hvd

DTYPES = ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "bfloat16",
          "float32", "float64", "bool"]
# The engine reduces in torch, which cannot sum uint16: moved (gathered, broadcast,
# exchanged) but not reduced here.
REDUCIBLE = [d for d in DTYPES if d not in ("bool", "uint16")]
TRAILING = {1: (), 2: (3,), 3: (3, 2)}
MODES = ["eager", "function", "graph"]


def value(rank: int, rows: int, dim: int, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s input: small values (1-3), exact under sums in every dtype."""
    shape = (rows, *TRAILING[dim])
    return ((np.arange(int(np.prod(shape))).reshape(shape) + rank + salt) % 3 + 1).astype(
        np.float64)


def cast(array: np.ndarray, dtype: str) -> np.ndarray:
    return (array % 2).astype(bool) if dtype == "bool" else array


def splits_of(rank: int, size: int) -> list[int]:
    """Rows ``rank`` sends to each rank: zero to some (rank 0 sends nothing to itself)."""
    return [(r + rank) % 3 for r in range(size)]


def calls(dtype: str, dim: int, rank: int, size: int, pset) -> list[tuple[str, object, object]]:
    """(key, function of TF tensors -> list of outputs, expected list) for one dtype and dim."""
    tfd = getattr(tf, dtype)
    out = []

    def t(array):
        return tf.constant(cast(array, dtype), dtype=tfd)

    full = [cast(value(r, 2 * size, dim), dtype) for r in range(size)]
    ragged = [cast(value(r, r, dim), dtype) for r in range(size)]  # rank 0: zero rows
    out.append(("allgather", lambda: [hvd.allgather(t(value(rank, rank, dim)),
                                                    name=f"ag.{dtype}.{dim}")],
                [np.concatenate(ragged)]))
    out.append(("grouped_allgather", lambda: hvd.grouped_allgather(
        [t(value(rank, rank, dim)), t(value(rank, 2 * size, dim))], name=f"gag.{dtype}.{dim}"),
        [np.concatenate(ragged), np.concatenate(full)]))
    out.append(("broadcast", lambda: [hvd.broadcast(t(value(rank, 2 * size, dim)), size - 1,
                                                    name=f"bc.{dtype}.{dim}")], [full[-1]]))
    sent = [np.split(cast(value(s, sum(splits_of(s, size)), dim), dtype),
                     np.cumsum(splits_of(s, size))[:-1]) for s in range(size)]
    out.append(("alltoall", lambda: list(hvd.alltoall(
        t(value(rank, sum(splits_of(rank, size)), dim)), splits=splits_of(rank, size),
        name=f"a2a.{dtype}.{dim}")),
        [np.concatenate([sent[s][rank] for s in range(size)]),
         np.array([splits_of(s, size)[rank] for s in range(size)])]))
    out.append(("alltoall_even", lambda: [hvd.alltoall(t(value(rank, 2 * size, dim)),
                                                       name=f"a2ae.{dtype}.{dim}")],
                [np.concatenate([np.split(full[s], size)[rank] for s in range(size)])]))
    out.append(("empty", lambda: [hvd.allgather(t(value(rank, 0, dim)), name=f"e.{dtype}.{dim}")],
                [cast(value(0, 0, dim), dtype)]))
    if dtype in REDUCIBLE:
        total = np.sum(full, 0)
        out.append(("allreduce", lambda: [hvd.allreduce(t(value(rank, 2 * size, dim)),
                                                        op=hvd.Sum, name=f"ar.{dtype}.{dim}")],
                    [total]))
        out.append(("allreduce_empty", lambda: [hvd.allreduce(
            t(value(rank, 0, dim)), op=hvd.Sum, name=f"are.{dtype}.{dim}")],
            [value(0, 0, dim)]))
        out.append(("grouped_allreduce", lambda: hvd.grouped_allreduce(
            [t(value(rank, 2 * size, dim))] * 2, op=hvd.Sum, name=f"gar.{dtype}.{dim}"),
            [total, total]))
        out.append(("reducescatter", lambda: [hvd.reducescatter(
            t(value(rank, 2 * size, dim)), op=hvd.Sum, name=f"rs.{dtype}.{dim}")],
            [total[2 * rank:2 * rank + 2]]))
        out.append(("grouped_reducescatter", lambda: hvd.grouped_reducescatter(
            [t(value(rank, 2 * size, dim))] * 2, op=hvd.Sum, name=f"grs.{dtype}.{dim}"),
            [total[2 * rank:2 * rank + 2]] * 2))
        if pset.included():
            members = pset.ranks
            out.append(("set_allreduce", lambda: [hvd.allreduce(
                t(value(rank, 2 * size, dim)), op=hvd.Sum, process_set=pset,
                name=f"sar.{dtype}.{dim}")], [np.sum([full[r] for r in members], 0)]))
    if pset.included():
        out.append(("set_broadcast", lambda: [hvd.broadcast(
            t(value(rank, 2 * size, dim)), pset.ranks[0], process_set=pset,
            name=f"sbc.{dtype}.{dim}")], [full[pset.ranks[0]]]))
    return out


class Checker:
    def __init__(self) -> None:
        self.checks = 0

    def equal(self, got, want, what: str) -> None:
        got_array = np.asarray(got)
        want_array = np.asarray(want)
        if got_array.dtype == bool or want_array.dtype == bool:
            ok = got_array.shape == want_array.shape and np.array_equal(got_array, want_array)
        else:
            ok = got_array.shape == want_array.shape and np.allclose(
                got_array.astype(np.float64), want_array.astype(np.float64), rtol=1e-2)
        if not ok:
            raise AssertionError(f"rank {hvd.rank()}: {what}: got {got_array!r}, "
                                 f"want {want_array!r}")
        self.checks += 1


def dtype_matrix(check: Checker, pset) -> None:
    rank, size = hvd.rank(), hvd.size()
    for dtype in DTYPES:
        for dim in (1, 2, 3):
            table = calls(dtype, dim, rank, size, pset)
            for mode in MODES:
                if mode == "eager":
                    results = [fn() for _, fn, _ in table]
                elif mode == "function":
                    results = tf.function(lambda table=table: [fn() for _, fn, _ in table])()
                else:
                    with tf.Graph().as_default():
                        fetches = [fn() for _, fn, _ in table]
                        with tf.compat.v1.Session() as session:
                            results = session.run(fetches)
                for (key, _, wants), gots in zip(table, results, strict=True):
                    for got, want in zip(gots, wants, strict=True):
                        check.equal(got, want, f"{mode} {key} {dtype} dim {dim}")


def gradients(check: Checker) -> None:
    rank, size = hvd.rank(), hvd.size()
    w = [np.arange(4.0).reshape(2, 2) + r for r in range(size)]
    cases = {  # key: (forward, expected gradient of sum(forward(x) * x_like))
        "allreduce": (lambda x: hvd.allreduce(x, op=hvd.Sum) * x, None),
        "allgather": (lambda x: hvd.allgather(x), None),
        "broadcast": (lambda x: hvd.broadcast(x, size - 1), None),
        "reducescatter": (lambda x: hvd.reducescatter(x, op=hvd.Sum), None),
        "alltoall": (lambda x: hvd.alltoall(x), None),
    }
    # d/dx sum(y * c): c is the weight each output element gets.
    expected = {
        # sum(allreduce(x) * x): x_r's gradient is sum_s x_s (the allreduced dy) + allreduce(x)
        "allreduce": np.sum(w, 0) * 2,
        # sum(allgather(x)): the average of ones over ranks, this rank's rows
        "allgather": np.ones((2, 2)),
        # sum(broadcast(x)): the average of ones at the root, zeros elsewhere
        "broadcast": np.ones((2, 2)) if rank == size - 1 else np.zeros((2, 2)),
        # sum(reducescatter_sum(x)): allgather of ones, times the set's size
        "reducescatter": np.ones((2, 2)) * size,
        "alltoall": np.ones((2, 2)),
    }
    for mode in ("eager", "graph"):
        for key, (forward, _) in cases.items():
            if key in ("reducescatter", "alltoall") and 2 % size:
                continue  # two rows split evenly only at 1 or 2 ranks
            if mode == "eager":
                x = tf.Variable(w[rank])
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(forward(x))
                grad = tape.gradient(loss, x).numpy()
            else:
                with tf.Graph().as_default():
                    x = tf.constant(w[rank])
                    (g,) = tf.gradients(tf.reduce_sum(forward(x)), [x])
                    with tf.compat.v1.Session() as session:
                        grad = session.run(g)
            check.equal(grad, expected[key], f"{mode} gradient of {key}")


def invalid_calls(check: Checker) -> int:
    rank, size = hvd.rank(), hvd.size()
    caught = 0
    unknown = hvd.ProcessSet([0])

    @tf.function
    def mismatched(x):
        return hvd.allreduce(x, name="fn.bad")

    cases = [
        (tf.errors.FailedPreconditionError,
         lambda: hvd.allreduce(tf.ones([rank + 1]), name="bad.shape")),
        (tf.errors.FailedPreconditionError,
         lambda: hvd.allreduce(tf.ones([2], tf.float32 if rank else tf.float64), name="bad.t")),
        (tf.errors.FailedPreconditionError,
         lambda: hvd.broadcast(tf.ones([2]), root_rank=rank, name="bad.root")),
        (tf.errors.FailedPreconditionError,
         lambda: hvd.allgather(tf.ones([1, rank + 1]), name="bad.gather")),
        (tf.errors.InvalidArgumentError,
         lambda: hvd.alltoall(tf.ones([3, 2]), splits=[5] + [0] * (size - 1), name="bad.s")),
        (tf.errors.InvalidArgumentError,
         lambda: hvd.alltoall(tf.ones([size + 1, 2]), name="bad.div")),
        (tf.errors.InvalidArgumentError,
         lambda: hvd.broadcast(tf.ones([2]), root_rank=size + 3, name="bad.range")),
        (ValueError, lambda: hvd.allreduce(tf.ones([2]), process_set=unknown)),
        (NotImplementedError, lambda: hvd.allreduce(
            tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0])), postscale_factor=2.0)),
        (RuntimeError, lambda: hvd.broadcast_global_variables(0)),
        (tf.errors.FailedPreconditionError, lambda: mismatched(tf.ones([rank + 1]))),
    ]
    for cls, call in cases:
        try:
            call()
        except cls:
            caught += 1
        else:
            raise AssertionError(f"rank {rank}: no {cls.__name__} from {call}")
        check.equal(hvd.allreduce(tf.constant(1.0), op=hvd.Sum, name="after.bad").numpy(),
                    float(size), "a valid call after an invalid one")
    with tf.Graph().as_default():
        bad = hvd.alltoall(tf.ones([3, 2]), splits=[5] + [0] * (size - 1), name="graph.bad")
        fine = hvd.allreduce(tf.constant(1.0), op=hvd.Sum, name="graph.fine")
        with tf.compat.v1.Session() as session:
            try:
                session.run(bad)
            except tf.errors.InvalidArgumentError:
                caught += 1
            check.equal(session.run(fine), float(size), "graph call after an invalid one")
    return caught


def main() -> int:
    hvd.init()
    check = Checker()
    pset = hvd.add_process_set(list(range(1, hvd.size())) or [0])
    dtype_matrix(check, pset)
    matrix = check.checks
    gradients(check)
    grads = check.checks - matrix
    caught = invalid_calls(check)
    hvd.barrier()
    last = int(hvd.join())
    if not 0 <= last < hvd.size():
        raise AssertionError(f"join returned {last}")
    hvd.remove_process_set(pset)
    if hvd.rank() == 0:
        print(f"tf dtype matrix: {matrix} checks; gradients: {grads} checks; "
              f"invalid calls: {caught} caught", flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
