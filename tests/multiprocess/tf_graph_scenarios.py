"""Worker functions for tests/multiprocess/test_tensorflow_graph.py (run by tests/support/worker_main.py).

TF1-style graphs (``tf.compat.v1.Session``) holding many independent
collectives, run with one and with two inter-op threads, and the error
classes of hora.tensorflow's ops in eager mode, in ``tf.function`` and in a
Session graph. The inputs come from :func:`value` (numpy only), so that the
test computes its reference without TensorFlow.
"""

from __future__ import annotations

import os

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

if __name__ == "scenario":  # in a worker: import TensorFlow before hvd.init() (tf_scenarios.py)
    import tensorflow  # noqa: F401

# (key, collective, dtypes): sixteen independent collectives of one graph.
GRAPH_CALLS = [
    ("sum_f32", "allreduce", ["float32"]), ("sum_i32", "allreduce", ["int32"]),
    ("avg_f16", "allreduce", ["float16"]), ("max_f64", "allreduce", ["float64"]),
    ("sum_bf16", "allreduce", ["bfloat16"]), ("gather_i64", "allgather", ["int64"]),
    ("gather_u8", "allgather", ["uint8"]), ("gather_i8", "allgather", ["int8"]),
    ("bcast_f32", "broadcast", ["float32"]), ("bcast_i16", "broadcast", ["int16"]),
    ("a2a_f32", "alltoall", ["float32"]), ("a2a_i32", "alltoall_even", ["int32"]),
    ("rs_f32", "reducescatter", ["float32"]), ("g_sum", "grouped_allreduce", ["float64", "float64"]),
    ("g_gather", "grouped_allgather", ["int32", "int32"]),
    ("g_rs", "grouped_reducescatter", ["int64", "int64"]),
]
THREADS = [1, 2]


def value(rank: int, rows: int, cols: int = 3) -> np.ndarray:
    """Small non-negative values, exact in every dtype of GRAPH_CALLS and in their sums."""
    return ((np.arange(rows * cols).reshape(rows, cols) % 5) + 1 + rank).astype(np.float64)


def splits_of(rank: int, size: int) -> list[int]:
    """The rows rank ``rank`` sends to each rank in the alltoall with splits (zero to some)."""
    return [(r + rank) % 3 for r in range(size)]


def _build(tf, hvd, rank: int, size: int) -> dict:
    """The sixteen collectives of GRAPH_CALLS, and their outputs by key."""
    outputs: dict = {}
    for key, call, dtypes in GRAPH_CALLS:
        ragged = "gather" in key
        rows = rank + 1 if ragged else (2 * size if call != "alltoall" else
                                        sum(splits_of(rank, size)))
        xs = [tf.constant(value(rank, rows), dtype=getattr(tf, d), name=f"{key}_{i}")
              for i, d in enumerate(dtypes)]
        if call == "allreduce":
            op = {"sum": hvd.Sum, "avg": hvd.Average, "max": hvd.Max}[key.split("_")[0]]
            outputs[key] = [hvd.allreduce(xs[0], op=op)]
        elif call == "allgather":
            outputs[key] = [hvd.allgather(xs[0])]
        elif call == "broadcast":
            outputs[key] = [hvd.broadcast(xs[0], root_rank=size - 1 if "f32" in key else 0)]
        elif call == "alltoall":
            outputs[key] = list(hvd.alltoall(xs[0], splits=splits_of(rank, size)))
        elif call == "alltoall_even":
            outputs[key] = [hvd.alltoall(xs[0])]
        elif call == "reducescatter":
            outputs[key] = [hvd.reducescatter(xs[0], op=hvd.Sum)]
        elif call == "grouped_allreduce":
            outputs[key] = hvd.grouped_allreduce(xs, op=hvd.Sum)
        elif call == "grouped_allgather":
            outputs[key] = hvd.grouped_allgather(xs)
        else:
            outputs[key] = hvd.grouped_reducescatter(xs, op=hvd.Sum)
    return outputs


def _numpy(values) -> list[np.ndarray]:
    return [np.asarray(v).astype(np.float64) for v in values]


def independent_collectives() -> dict:
    """Runs one Session graph of sixteen independent collectives with 1 and 2 inter-op
    threads (twice each: the second run hits the response cache), fetches one collective
    alone while another waits on an unfed placeholder, and takes a gradient."""
    import tensorflow as tf

    import hora.tensorflow as hvd

    rank, size = hvd.rank(), hvd.size()
    result: dict = {}
    with tf.Graph().as_default():
        outputs = _build(tf, hvd, rank, size)
        fed = tf.compat.v1.placeholder(tf.float32, [2], name="fed")
        needs_feed = hvd.allreduce(fed, op=hvd.Sum)
        weight = tf.constant([float(rank + 1), 2.0])
        gathered = hvd.allgather(weight * 3.0)
        (grad,) = tf.gradients(tf.reduce_sum(gathered * gathered), [weight])
        adasum = hvd.allreduce(weight, op=hvd.Adasum, name="adasum")
        for threads in THREADS:
            config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads,
                                              intra_op_parallelism_threads=1)
            with tf.compat.v1.Session(config=config) as session:
                for _ in range(2):
                    got = session.run(outputs)
                    result[threads] = {k: _numpy(v) for k, v in got.items()}
                # Fetching one collective runs it alone: the unfed one is not needed.
                result[(threads, "alone")] = _numpy([session.run(outputs["sum_f32"][0])])
                result[(threads, "fed")] = _numpy([session.run(
                    needs_feed, {fed: [1.0, float(rank)]})])
                result[(threads, "grad")] = _numpy([session.run(grad)])
                result[(threads, "adasum")] = _numpy([session.run(adasum)])
    # The same Adasum, eager: a graph's composite handle (Adasum's) completes its op too.
    result["adasum"] = _numpy([hvd.allreduce(tf.constant([float(rank + 1), 2.0]),
                                             op=hvd.Adasum, name="adasum.eager")])
    return result


def _expect(record: dict, key: str, cls, call, check=None) -> None:
    """Records whether ``call()`` raised ``cls`` (and the engine's error behind it)."""
    import hora.tensorflow as hvd

    try:
        call()
    except cls as exc:
        behind = hvd.mpi_ops.engine_error(exc)
        record[key] = ("caught", type(exc).__name__, type(behind).__name__)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        record[key] = ("other", type(exc).__name__, str(exc)[:400])
    else:
        record[key] = ("no error",)


def errors() -> dict:
    """Every invalid call, eager, in tf.function and in a Session graph, each caught as
    the TensorFlow class Horovod raises; a valid call after each must still work."""
    import tensorflow as tf

    import hora.tensorflow as hvd

    rank, size = hvd.rank(), hvd.size()
    record: dict = {}
    after: list = []
    first = hvd.add_process_set([0])
    unknown = hvd.ProcessSet([0, 1])  # never added

    def valid() -> None:
        after.append(float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum, name="after").numpy()))

    eager_calls = {
        "shape": (tf.errors.FailedPreconditionError, lambda: hvd.allreduce(
            tf.ones([rank + 1]), name="shape")),
        "dtype": (tf.errors.FailedPreconditionError, lambda: hvd.allreduce(
            tf.ones([2], tf.float32 if rank else tf.float64), name="dtype")),
        "root": (tf.errors.FailedPreconditionError, lambda: hvd.broadcast(
            tf.ones([2]), root_rank=rank, name="root")),
        "op": (tf.errors.FailedPreconditionError, lambda: hvd.allreduce(
            tf.ones([2]), op=hvd.Sum if rank else hvd.Max, name="op")),
        "splits": (tf.errors.InvalidArgumentError, lambda: hvd.alltoall(
            tf.ones([3, 2]), splits=[5] + [0] * (size - 1), name="splits")),
        "divisible": (tf.errors.InvalidArgumentError, lambda: hvd.alltoall(
            tf.ones([size + 1, 2]), name="divisible")),
        "unknown_set": (ValueError, lambda: hvd.allreduce(tf.ones([2]), process_set=unknown)),
        "sparse_scale": (NotImplementedError, lambda: hvd.allreduce(
            tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0])), prescale_factor=2.0)),
        "global_variables": (RuntimeError, lambda: hvd.broadcast_global_variables(0)),
    }
    for key, (cls, call) in eager_calls.items():
        _expect(record, f"eager.{key}", cls, call)
        valid()
    record["eager.hvd_class"] = []
    try:
        hvd.alltoall(tf.ones([3, 2]), splits=[5] + [0] * (size - 1), name="splits2")
    except hvd.InvalidCallError as exc:  # hora's class catches it too
        record["eager.hvd_class"] = [c.__name__ for c in type(exc).__mro__]
    valid()

    @tf.function
    def mismatched(x):
        return hvd.allreduce(x, name="fn.shape")

    @tf.function
    def bad_splits(x):
        return hvd.alltoall(x, splits=[5] + [0] * (size - 1), name="fn.splits")

    _expect(record, "function.shape", tf.errors.FailedPreconditionError,
            lambda: mismatched(tf.ones([rank + 1])))
    valid()
    _expect(record, "function.splits", tf.errors.InvalidArgumentError,
            lambda: bad_splits(tf.ones([3, 2])))
    valid()

    with tf.Graph().as_default():
        shape = hvd.allreduce(tf.ones([rank + 1]), name="graph.shape")
        splits = hvd.alltoall(tf.ones([3, 2]), splits=[5] + [0] * (size - 1),
                              name="graph.splits")
        fine = hvd.allreduce(tf.constant(1.0), op=hvd.Sum, name="graph.after")
        variable = tf.compat.v1.get_variable("w", initializer=tf.fill([2], float(rank + 5)))
        _expect(record, "graph.unknown_set", ValueError,
                lambda: hvd.allreduce(tf.ones([2]), process_set=unknown))
        sync = hvd.broadcast_global_variables(size - 1)
        sizes = [hvd.size_op(), hvd.size_op(process_set_id=first.process_set_id),
                 hvd.process_set_included_op(process_set_id=first.process_set_id)]
        _expect(record, "graph.size_op_unknown", ValueError, lambda: hvd.size_op(99))
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            for key, op, cls in (("graph.shape", shape, tf.errors.FailedPreconditionError),
                                 ("graph.splits", splits, tf.errors.InvalidArgumentError)):
                _expect(record, key, cls, lambda op=op: session.run(op))
                after.append(float(session.run(fine)))
            session.run(sync)
            record["graph.global_variables"] = session.run(variable).tolist()
            record["graph.sizes"] = [int(v) for v in session.run(sizes)]
    hvd.remove_process_set(first)
    record["after"] = after
    return record


def everything() -> dict:
    """Both scenarios in one launch (TensorFlow's import costs seconds per process)."""
    return {"graph": independent_collectives(), "errors": errors()}
