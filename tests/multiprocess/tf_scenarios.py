"""Worker functions for tests/multiprocess/test_tensorflow.py (run by tests/support/worker_main.py).

Every collective of hora.tensorflow, eager and inside tf.function, over the
dtypes TF offers; the inputs come from :func:`make_input` (numpy only), so
that the test computes its single-process reference without TensorFlow.
"""

from __future__ import annotations

import os

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64"]
REDUCE_OPS = ["Sum", "Average", "Min", "Max", "Product"]
MODES = ["eager", "graph"]


def make_input(rank: int, dtype: str, rows: int = 3, cols: int = 4) -> np.ndarray:
    """Small values (exact in float16 and bfloat16, and in their products over 3 ranks)."""
    base = (np.arange(rows * cols).reshape(rows, cols) % 5) + 1 + rank
    if dtype.startswith("int"):
        base = base - 2  # negatives too
    return base.astype(np.float64)


def _tf_dtype(tf, dtype: str):
    return getattr(tf, dtype)


def _np(t) -> np.ndarray:
    return np.asarray(t.numpy()).astype(np.float64)


def collectives():
    """Runs every collective in both modes; returns {key: result as float64 numpy}."""
    import tensorflow as tf

    import hora.tensorflow as hvd

    rank, size = hvd.rank(), hvd.size()
    out: dict = {}
    odd = hvd.add_process_set([r for r in range(size) if r % 2 == 0])

    def run(mode, fn, *args):
        if mode == "eager":
            return fn(*args)
        return tf.function(fn)(*args)

    for mode in MODES:
        for dtype in DTYPES:
            dt = _tf_dtype(tf, dtype)
            x = tf.constant(make_input(rank, dtype), dtype=dt)
            for op in REDUCE_OPS:
                out[(mode, "allreduce", op, dtype)] = _np(run(
                    mode, lambda t, op=op: hvd.allreduce(t, op=getattr(hvd, op)), x))
            if dtype.startswith("float"):
                out[(mode, "allreduce_scaled", dtype)] = _np(run(mode, lambda t: hvd.allreduce(
                    t, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0), x))
            y = tf.constant(make_input(rank, dtype) * 2, dtype=dt)
            out[(mode, "grouped_allreduce", dtype)] = [_np(t) for t in run(
                mode, lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Sum), x, y)]
            ragged = tf.constant(make_input(rank, dtype, rows=rank + 1), dtype=dt)
            out[(mode, "allgather", dtype)] = _np(run(mode, hvd.allgather, ragged))
            out[(mode, "grouped_allgather", dtype)] = [_np(t) for t in run(
                mode, lambda a, b: hvd.grouped_allgather([a, b]), ragged, x)]
            out[(mode, "broadcast", dtype)] = _np(run(
                mode, lambda t: hvd.broadcast(t, root_rank=size - 1), x))
            splits = [(r + rank) % 2 + 1 for r in range(size)]
            a2a = tf.constant(make_input(rank, dtype, rows=sum(splits)), dtype=dt)
            got, received = run(mode, lambda t, s=splits: hvd.alltoall(t, splits=s), a2a)
            out[(mode, "alltoall", dtype)] = (_np(got), received.numpy().tolist())
            even = tf.constant(make_input(rank, dtype, rows=2 * size), dtype=dt)
            out[(mode, "alltoall_even", dtype)] = _np(run(mode, hvd.alltoall, even))
            for op in ("Sum", "Average"):
                out[(mode, "reducescatter", op, dtype)] = _np(run(
                    mode, lambda t, op=op: hvd.reducescatter(t, op=getattr(hvd, op)),
                    tf.constant(make_input(rank, dtype, rows=size + 1), dtype=dt)))
            out[(mode, "grouped_reducescatter", dtype)] = [_np(t) for t in run(
                mode, lambda a, b: hvd.grouped_reducescatter([a, b], op=hvd.Sum), even, even)]
            if odd.included():
                out[(mode, "set_allreduce", dtype)] = _np(run(
                    mode, lambda t: hvd.allreduce(t, op=hvd.Sum, process_set=odd), x))
                out[(mode, "set_allgather", dtype)] = _np(run(
                    mode, lambda t: hvd.allgather(t, process_set=odd), ragged))
                out[(mode, "set_broadcast", dtype)] = _np(run(
                    mode, lambda t: hvd.broadcast(t, root_rank=0, process_set=odd), x))
    out["fp16_compressed"] = _np(hvd.allreduce(tf.constant(make_input(rank, "float32")),
                                               op=hvd.Sum, compression=hvd.Compression.fp16))
    out["bool_sum"] = hvd.allreduce(tf.constant([rank == 0, False, True]),
                                    op=hvd.Sum).numpy().tolist()
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
    start = hvd.broadcast_object({"w": w.numpy()} if rank == 0 else None, root_rank=0)
    return {"w": w.numpy(), "same_object": start["w"].shape,
            "gathered": hvd.allgather_object(rank)}


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
    return {"distributed": [w for w in distributed.get_weights()],
            "alone": [w for w in alone.get_weights()],
            "initial": [w for w in model().get_weights()]}


def everything():
    """All of the above in one run: TensorFlow's import is the costly part."""
    return {"collectives": collectives(), "gradients": gradients(), "training": training(),
            "keras": keras_equality()}
