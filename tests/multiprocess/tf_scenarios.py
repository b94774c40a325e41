"""Worker functions for tests/multiprocess/test_tensorflow.py (run by tests/support/worker_main.py).

Every collective of hora.tensorflow, eager and inside tf.function, over the
dtypes TF offers; the inputs come from :func:`make_input` (numpy only), so
that the test computes its single-process reference without TensorFlow.
"""

from __future__ import annotations

import os

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

if __name__ == "scenario":  # in a worker (tests/support/worker_main.py), not in the test
    # Imported before hvd.init(): a long import right after it could starve the
    # heartbeat thread on a loaded machine.
    import tensorflow  # noqa: F401

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64"]
REDUCE_OPS = ["Sum", "Average", "Min", "Max", "Product"]
MODES = ["eager", "graph"]
# horovod.tensorflow's public names (Horovod 0.28.1), the TF1-only ones left out.
HOROVOD_TF_NAMES = [
    "Adasum", "Average", "Compression", "DistributedGradientTape", "DistributedOptimizer",
    "Max", "Min", "PartialDistributedGradientTape", "ProcessSet", "Product", "Sum",
    "SyncBatchNormalization", "add_process_set", "allgather", "allgather_object", "allreduce",
    "alltoall", "barrier", "broadcast", "broadcast_", "broadcast_object", "broadcast_object_fn",
    "broadcast_variables", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "elastic", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allreduce", "grouped_reducescatter", "init", "is_homogeneous", "is_initialized",
    "join", "local_rank", "local_rank_op", "local_size", "local_size_op", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "process_set_included_op", "rank",
    "rank_op", "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size",
    "size_op", "start_timeline", "stop_timeline",
]
# Not in hora.tensorflow yet (README, "Not yet").
NOT_YET: list[str] = []


def make_input(rank: int, dtype: str, rows: int = 3, cols: int = 4) -> np.ndarray:
    """Small values (exact in float16 and bfloat16, and in their products over 3 ranks)."""
    base = (np.arange(rows * cols).reshape(rows, cols) % 5) + 1 + rank
    if dtype.startswith("int"):
        base = base - 2  # negatives too
    return base.astype(np.float64)


def bn_input(rank: int) -> np.ndarray:
    """A batch of rank + 2 rows and 3 features, different on every rank."""
    rows = rank + 2
    return (np.arange(rows * 3).reshape(rows, 3) * (rank + 1) % 7 + rank).astype("float32")


def _tf_dtype(tf, dtype: str):
    return getattr(tf, dtype)


def _np(t) -> np.ndarray:
    return np.asarray(t.numpy()).astype(np.float64)


def collectives():
    """Runs every collective in both modes; returns {key: result as float64 numpy}.

    In graph mode all the calls for one dtype are one ``tf.function``: they must run in
    program order on every rank, as a training step's would.
    """
    import tensorflow as tf

    import hora.tensorflow as hvd

    rank, size = hvd.rank(), hvd.size()
    out: dict = {}
    odd = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    splits = [(r + rank) % 2 + 1 for r in range(size)]

    def calls(x, y, ragged, a2a, even, uneven):
        got = {}
        for op in REDUCE_OPS:
            got[("allreduce", op)] = hvd.allreduce(x, op=getattr(hvd, op))
        if x.dtype.is_floating:
            got[("allreduce_scaled",)] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5,
                                                       postscale_factor=4.0)
        got[("grouped_allreduce",)] = hvd.grouped_allreduce([x, y], op=hvd.Sum)
        got[("allgather",)] = hvd.allgather(ragged)
        got[("grouped_allgather",)] = hvd.grouped_allgather([ragged, x])
        got[("broadcast",)] = hvd.broadcast(x, root_rank=size - 1)
        got[("alltoall",)] = hvd.alltoall(a2a, splits=splits)
        got[("alltoall_even",)] = hvd.alltoall(even)
        for op in ("Sum", "Average"):
            got[("reducescatter", op)] = hvd.reducescatter(uneven, op=getattr(hvd, op))
        got[("grouped_reducescatter",)] = hvd.grouped_reducescatter([even, even], op=hvd.Sum)
        if odd.included():
            got[("set_allreduce",)] = hvd.allreduce(x, op=hvd.Sum, process_set=odd)
            got[("set_allgather",)] = hvd.allgather(ragged, process_set=odd)
            got[("set_broadcast",)] = hvd.broadcast(x, root_rank=0, process_set=odd)
        return got

    for mode in MODES:
        for dtype in DTYPES:
            dt = _tf_dtype(tf, dtype)
            args = [tf.constant(make_input(rank, dtype, rows=rows) * scale, dtype=dt)
                    for rows, scale in ((3, 1), (3, 2), (rank + 1, 1), (sum(splits), 1),
                                        (2 * size, 1), (size + 1, 1))]
            got = calls(*args) if mode == "eager" else tf.function(calls)(*args)
            for key, value in got.items():
                if key == ("alltoall",):
                    value = (_np(value[0]), value[1].numpy().tolist())
                elif isinstance(value, (list, tuple)):
                    value = [_np(v) for v in value]
                else:
                    value = _np(value)
                out[(mode, *key[:1], *key[1:], dtype)] = value
    # One group of three dtypes (Horovod takes it): a model with float64 variables
    # sends its gradients so.
    mixed = [tf.constant(make_input(rank, dtype), dtype=_tf_dtype(tf, dtype))
             for dtype in ("float32", "float64", "int32")]
    for mode in MODES:
        def group(*xs):
            return hvd.grouped_allreduce(list(xs), op=hvd.Sum)
        got = group(*mixed) if mode == "eager" else tf.function(group)(*mixed)
        out[(mode, "mixed_group")] = [(v.dtype.name, _np(v)) for v in got]
    out["fp16_compressed"] = _np(hvd.allreduce(tf.constant(make_input(rank, "float32")),
                                               op=hvd.Sum, compression=hvd.Compression.fp16))
    out["bool_sum"] = hvd.allreduce(tf.constant([rank == 0, False, True]),
                                    op=hvd.Sum).numpy().tolist()
    # Adasum is the engine's (hora.torch's) rule, whichever framework asks.
    import torch

    import hora.torch

    values = make_input(rank, "float32") * (rank + 1) - 4
    out["adasum"] = (_np(hvd.allreduce(tf.constant(values, dtype=tf.float32), op=hvd.Adasum)),
                     hora.torch.allreduce(torch.tensor(values, dtype=torch.float32),
                                          op=hora.torch.Adasum).double().numpy())
    out["missing"] = [n for n in HOROVOD_TF_NAMES if not hasattr(hvd, n)]
    return out


def gradients():
    """The gradient of each differentiable collective, eager and in tf.function."""
    import tensorflow as tf

    import hora.tensorflow as hvd

    rank, size = hvd.rank(), hvd.size()
    out: dict = {}
    weight = tf.constant(make_input(rank, "float32") * (rank + 1), dtype=tf.float32)

    def grad_of(mode, loss_fn, x):
        def step(v):
            with tf.GradientTape() as tape:
                tape.watch(v)
                loss = loss_fn(v)
            return tape.gradient(loss, v)
        return _np(step(x) if mode == "eager" else tf.function(step)(x))

    x = tf.constant(make_input(rank, "float32"), dtype=tf.float32)
    for mode in MODES:
        for op in ("Sum", "Average"):
            out[(mode, "allreduce", op)] = grad_of(
                mode, lambda v, op=op: tf.reduce_sum(hvd.allreduce(v, op=getattr(hvd, op))
                                                     * weight), x)
        out[(mode, "grouped_allreduce")] = grad_of(
            mode, lambda v: tf.reduce_sum(hvd.grouped_allreduce([v, v * 2], op=hvd.Sum)[1]
                                          * weight), x)
        ragged = tf.constant(make_input(rank, "float32", rows=rank + 1), dtype=tf.float32)
        total = size * (size + 1) // 2
        gather_weight = tf.constant(make_input(rank, "float32", rows=total) * (rank + 1),
                                    dtype=tf.float32)
        out[(mode, "allgather")] = grad_of(
            mode, lambda v, w=gather_weight: tf.reduce_sum(hvd.allgather(v) * w), ragged)
        out[(mode, "broadcast")] = grad_of(
            mode, lambda v: tf.reduce_sum(hvd.broadcast(v, root_rank=1) * weight), x)
        even = tf.constant(make_input(rank, "float32", rows=2 * size), dtype=tf.float32)
        rs_weight = tf.constant(make_input(rank, "float32", rows=2) * (rank + 1),
                                dtype=tf.float32)
        out[(mode, "reducescatter")] = grad_of(
            mode, lambda v, w=rs_weight: tf.reduce_sum(hvd.reducescatter(v, op=hvd.Sum) * w),
            even)
        out[(mode, "alltoall")] = grad_of(
            mode, lambda v, w=gather_weight: tf.reduce_sum(hvd.alltoall(v) * w[:2 * size]), even)
    return out


def training():
    """DistributedGradientTape and broadcast_variables on a tiny linear model."""
    import tensorflow as tf

    import hora.tensorflow as hvd

    rank = hvd.rank()
    tf.random.set_seed(rank)  # different starting points: the broadcast must fix them
    w = tf.Variable(tf.random.normal([4, 1]))
    hvd.broadcast_variables([w], root_rank=0)
    xs = tf.constant(make_input(rank, "float32"), dtype=tf.float32)
    ys = tf.reduce_sum(xs, axis=1, keepdims=True)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.matmul(xs, w) - ys) ** 2)
        grads = hvd.DistributedGradientTape(tape).gradient(loss, [w])
        w.assign_sub(0.01 * grads[0])
        return loss

    for _ in range(5):
        step()
    root_w = hvd.broadcast_object({"w": w.numpy()} if rank == 0 else None, root_rank=0)["w"]

    # Sparse gradients (tf.gather): IndexedSlices are allgathered and averaged.
    size = hvd.size()
    table = tf.Variable(tf.ones([size + 1, 2]))
    sparse = {}
    for as_dense in (False, True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, [rank]) * (rank + 1))
        grad = hvd.DistributedGradientTape(tape, sparse_as_dense=as_dense).gradient(
            loss, [table])[0]
        sparse[as_dense] = (type(grad).__name__, tf.convert_to_tensor(grad).numpy())

    # PartialDistributedGradientTape: the local layer's gradient stays on this rank
    # (divided by the size), the other is averaged.
    shared_layer, local_layer = tf.keras.layers.Dense(1), tf.keras.layers.Dense(1)
    features = tf.constant([[float(rank + 1)]])
    shared_layer(features), local_layer(features)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(shared_layer(features) + local_layer(features))
    partial = hvd.PartialDistributedGradientTape(tape, local_layers=[local_layer]).gradient(
        loss, [shared_layer.kernel, local_layer.kernel])
    partial_grads = [float(tf.reshape(g, [])) for g in partial]

    # SyncBatchNormalization: every rank normalises with the global batch's statistics.
    norm = hvd.SyncBatchNormalization()
    normalised = norm(tf.constant(bn_input(rank)), training=True).numpy()

    # A call that is wrong on one rank fails on every rank, eagerly and inside tf.function.
    errors = {}
    bad_root = 99 if rank == 0 else 0
    try:
        hvd.broadcast(tf.ones([2]), root_rank=bad_root, name="bad.eager")
    except hvd.InvalidCallError as exc:
        errors["eager"] = type(exc).__name__
    try:
        tf.function(lambda t: hvd.broadcast(t, root_rank=bad_root, name="bad.graph"))(
            tf.ones([2]))
    except tf.errors.OpError as exc:
        errors["graph"] = type(hvd.mpi_ops.engine_error(exc)).__name__
    after = hvd.allreduce(tf.ones([1]), op=hvd.Sum).numpy().tolist()  # the world goes on
    return {"w": w.numpy(), "root_w": root_w, "gathered": hvd.allgather_object(rank),
            "sparse": sparse, "partial": partial_grads, "sync_bn": normalised, "errors": errors, "after": after, "shim": shim_names()}


def shim_names():
    """What ``import horovod.tensorflow`` and friends give under horovodrun's import shim."""
    import sys

    from hora._compat import shim_path

    sys.path.insert(0, shim_path())
    import horovod.keras
    import horovod.keras.callbacks
    import horovod.tensorflow
    import horovod.tensorflow.keras
    import horovod.tensorflow.keras.elastic

    import hora.tensorflow
    import hora.tensorflow.keras

    return {
        "tensorflow": horovod.tensorflow.DistributedGradientTape
        is hora.tensorflow.DistributedGradientTape,
        "keras": horovod.keras.DistributedOptimizer is hora.tensorflow.keras.DistributedOptimizer,
        "callbacks": horovod.keras.callbacks.MetricAverageCallback
        is hora.tensorflow.keras.callbacks.MetricAverageCallback,
        "elastic": horovod.tensorflow.keras.elastic.KerasState
        is hora.tensorflow.keras.elastic.KerasState,
        "keras_callbacks": horovod.tensorflow.keras.callbacks.BroadcastGlobalVariablesCallback
        is hora.tensorflow.keras.callbacks.BroadcastGlobalVariablesCallback,
    }


def keras_equality(samples: int = 480, local_batch: int = 16):
    """One epoch of SGD with hvd.DistributedOptimizer over every rank's part of each global
    batch, and then the same epoch in this process alone on the whole batches."""
    import tensorflow as tf
    from sklearn.datasets import load_digits

    import hora.tensorflow.keras as hvd

    keras = tf.keras
    rank, size = hvd.rank(), hvd.size()
    digits = load_digits()
    x = (digits.data[:samples] / 16.0).astype("float32")
    y = digits.target[:samples].astype("int64")
    batch = local_batch * size
    # Whole updates only, also with two passes per update: a pass left over at the end
    # is accumulated but never applied, where one process would apply a half batch.
    samples = samples // (2 * batch) * (2 * batch)
    x, y = x[:samples], y[:samples]
    mine = np.concatenate([np.arange(k * batch + rank * local_batch,
                                     k * batch + (rank + 1) * local_batch)
                           for k in range(samples // batch)])

    def model():
        keras.utils.set_random_seed(1234)
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="tanh"),
                                 keras.layers.Dense(10)])

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    distributed = model()
    distributed.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                        loss=loss)
    distributed.fit(x[mine], y[mine], batch_size=local_batch, epochs=1, shuffle=False,
                    verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    alone = model()
    alone.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    alone.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    # backward_passes_per_step=2: two local batches accumulated, reduced once per update,
    # equal to one process on batches twice as large.
    accumulated = model()
    accumulated.compile(optimizer=hvd.DistributedOptimizer(
        keras.optimizers.SGD(0.1), backward_passes_per_step=2,
        average_aggregated_gradients=True), loss=loss)
    accumulated.fit(x[mine], y[mine], batch_size=local_batch, epochs=1, shuffle=False,
                    verbose=0)
    alone_twice = model()
    alone_twice.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    alone_twice.fit(x, y, batch_size=2 * batch, epochs=1, shuffle=False, verbose=0)
    return {"distributed": [w for w in distributed.get_weights()],
            "alone": [w for w in alone.get_weights()],
            "accumulated": accumulated.get_weights(), "alone_twice": alone_twice.get_weights(),
            "initial": [w for w in model().get_weights()]}


def everything():
    """All of the above in one run: TensorFlow's import is the costly part."""
    return {"collectives": collectives(), "gradients": gradients(), "training": training(),
            "keras": keras_equality()}
