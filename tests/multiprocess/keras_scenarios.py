"""Worker functions for tests/multiprocess/test_keras_contract.py (run by
tests/support/worker_main.py).

Horovod's Keras and TensorFlow contract beyond plain averaging: the broadcast
callback's local variables, PartialDistributedOptimizer, elastic state that
restores to what sync() made it, local gradient aggregation on tf-keras and
``tf.compat.v1`` optimizers, the learning-rate callbacks' momentum correction,
and the semi-public helpers that scripts import from ``horovod.*``. Each
function returns plain numbers and arrays; the test holds the references.
"""

from __future__ import annotations

import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

if __name__ == "scenario":  # in a worker: TensorFlow's long import before hvd.init()
    import tensorflow  # noqa: F401

# Horovod 0.28.1 names a script may import, per module, checked through the shim.
HOROVOD_NAMES = {
    "horovod.tensorflow": [
        "BroadcastGlobalVariablesHook", "PartialDistributedGradientTape", "_cache",
        "_executing_eagerly", "_get_process_set_ids_and_ranks", "_make_subgraph",
        "check_num_rank_power_of_2", "gpu_available", "handle_average_backwards_compatibility",
        "refs_to_vars", "split_list", "vars_to_refs", "DistributedOptimizer",
        "broadcast_global_variables", "broadcast_object_fn", "SyncBatchNormalization",
    ],
    "horovod.tensorflow.util": ["_executing_eagerly", "_cache", "_make_subgraph",
                                "vars_to_refs", "refs_to_vars"],
    "horovod.tensorflow.functions": ["allgather_object", "broadcast_object",
                                     "broadcast_object_fn", "broadcast_variables"],
    "horovod.tensorflow.sync_batch_norm": ["SyncBatchNormalization"],
    "horovod.tensorflow.keras": [
        "DistributedOptimizer", "PartialDistributedOptimizer", "load_model",
        "broadcast_global_variables", "callbacks", "elastic", "allreduce", "allgather",
        "broadcast", "reducescatter", "init", "rank", "size", "Compression",
    ],
    "horovod.keras": ["DistributedOptimizer", "PartialDistributedOptimizer", "load_model",
                      "callbacks", "elastic"],
    "horovod.tensorflow.keras.callbacks": [
        "BroadcastGlobalVariablesCallback", "MetricAverageCallback",
        "LearningRateScheduleCallback", "LearningRateWarmupCallback", "BestModelCheckpoint",
    ],
    "horovod.keras.callbacks": [
        "BroadcastGlobalVariablesCallback", "MetricAverageCallback",
        "LearningRateScheduleCallback", "LearningRateWarmupCallback", "BestModelCheckpoint",
    ],
    "horovod.tensorflow.keras.elastic": [
        "KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
        "UpdateEpochStateCallback", "run",
    ],
    "horovod.tensorflow.elastic": ["TensorFlowKerasState", "TensorFlowState", "run"],
    "horovod.torch": ["_get_process_set_ids_and_ranks", "check_extension", "gpu_available",
                      "split_list"],
    "horovod.torch.mpi_ops": ["_get_process_set_ids_and_ranks", "check_num_rank_power_of_2",
                              "handle_average_backwards_compatibility"],
    "horovod.runner.common.util.env": ["get_env_rank_and_size"],
    "horovod.common.process_sets": ["ProcessSet", "global_process_set", "add_process_set",
                                    "remove_process_set", "_get_process_set_ids_and_ranks"],
}


def _keras3() -> bool:
    import tensorflow as tf

    return hasattr(tf.keras.optimizers.Optimizer, "stateless_apply")


def _dense_model(seed: int = 7):
    import tensorflow as tf

    keras = tf.keras
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="shared"),
                              keras.layers.Dense(2, name="mine")])
    return model


def broadcast_callback():
    """Rank-made weights, one fit step at learning rate 0: the callback broadcasts every
    variable but the local ones."""
    import tensorflow as tf

    import hora.tensorflow.keras as hvd

    rank = hvd.rank()
    model = _dense_model()
    model.compile(optimizer=tf.keras.optimizers.SGD(0.0), loss="mse")
    for i, variable in enumerate(model.variables):
        variable.assign(np.full(variable.shape, rank * 10.0 + i, dtype="float32"))
    local = model.get_layer("mine").kernel
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=local)
    x = np.ones((2, 3), "float32")
    model.fit(x, np.zeros((2, 2), "float32"), batch_size=2, epochs=1, verbose=0,
              callbacks=[callback])
    errors = []
    for bad in (["not a variable"], [3]):
        try:
            hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=bad)
        except ValueError as exc:
            errors.append(str(exc))
    names = [getattr(v, "path", None) or v.name for v in model.variables]
    values = zip(names, model.variables, strict=True)
    return {"values": {n: float(np.asarray(v).flat[0]) for n, v in values},
            "local": getattr(local, "path", None) or local.name, "errors": errors}


def partial_optimizer():
    """PartialDistributedOptimizer: the shared layer's gradients are averaged, the local
    layer's kept (divided by the size with scale_local_gradients), eagerly and in fit."""
    import tensorflow as tf

    import hora.tensorflow.keras as hvd

    rank, size = hvd.rank(), hvd.size()
    out = {}
    for scale in (True, False):
        model = _dense_model()
        model.build((None, 3))
        opt = hvd.PartialDistributedOptimizer(tf.keras.optimizers.SGD(1.0),
                                              local_layers=model.get_layer("mine"),
                                              scale_local_gradients=scale)
        before = [np.asarray(v).copy() for v in model.trainable_variables]
        grads = [tf.fill(v.shape, float(rank + 1)) for v in model.trainable_variables]
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        out[("eager", scale)] = [b - np.asarray(v) for b, v in
                                 zip(before, model.trainable_variables, strict=True)]
    # In model.fit (a tf.function): the applied step against this rank's own gradients.
    model = _dense_model()
    model.build((None, 3))
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(4, 3)).astype("float32")
    y = rng.normal(size=(4, 2)).astype("float32")
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    own = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    before = [np.asarray(v).copy() for v in model.trainable_variables]
    model.compile(optimizer=hvd.PartialDistributedOptimizer(
        tf.keras.optimizers.SGD(1.0), local_layers=[model.get_layer("mine")]), loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    out["fit"] = [b - np.asarray(v) for b, v in zip(before, model.trainable_variables, strict=True)]
    out["own"] = own
    try:
        hvd.PartialDistributedOptimizer(tf.keras.optimizers.SGD(1.0), local_layers=["dense"])
    except ValueError as exc:
        out["error"] = str(exc)
    out["size"] = size
    return out


def elastic_states():
    """Each state class: own values, sync() (rank 0's win), changes, restore(): every rank
    goes back to what sync() gave it, not to its own values from before the sync."""
    import tensorflow as tf
    import torch

    import hora.tensorflow.keras as hvd_keras
    import hora.torch as hvd_torch
    from hora.tensorflow import elastic as tf_elastic

    rank = hvd_keras.rank()
    own = float(rank + 1)
    out = {}

    model = _dense_model()
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
    model.build((None, 3))
    for v in model.variables:
        v.assign(np.full(v.shape, own, "float32"))
    state = hvd_keras.elastic.KerasState(model, epoch=rank)
    state.sync()
    for v in model.variables:
        v.assign(np.full(v.shape, 99.0, "float32"))
    state.epoch = 99
    state.restore()
    out["keras"] = ([float(np.asarray(v).flat[0]) for v in model.variables], state.epoch)

    variable = tf.Variable(np.full((2,), own, "float32"))
    tf_state = tf_elastic.TensorFlowState([variable], batch=rank)
    tf_state.sync()
    variable.assign([99.0, 99.0])
    tf_state.restore()
    out["tensorflow"] = (variable.numpy().tolist(), tf_state.batch)

    module = torch.nn.Linear(2, 1)
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(own)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(rank):  # every rank a step further
        optimizer.step()
        scheduler.step()
    torch_state = hvd_torch.elastic.TorchState(module, optimizer, scheduler=scheduler,
                                               epoch=rank)
    torch_state.sync()
    synced_lr = (scheduler.last_epoch, optimizer.param_groups[0]["lr"])
    optimizer.step()
    scheduler.step()
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(99.0)
    torch_state.epoch = 99
    torch_state.restore()
    out["torch"] = ([p.detach().flatten().tolist() for p in module.parameters()],
                    torch_state.epoch)
    out["scheduler"] = (synced_lr, (scheduler.last_epoch, optimizer.param_groups[0]["lr"]))
    # A model put in the state is saved as it is then: restore() goes back to that.
    replacement = torch.nn.Linear(2, 1)
    with torch.no_grad():
        for p in replacement.parameters():
            p.fill_(5.0)
    torch_state.model = replacement
    with torch.no_grad():
        for p in replacement.parameters():
            p.fill_(7.0)
    torch_state.restore()
    out["torch_replaced"] = [p.detach().flatten().tolist() for p in replacement.parameters()]

    object_state = hvd_torch.elastic.ObjectState(epoch=rank, seen=[rank])
    object_state.sync()
    object_state.epoch, object_state.seen = 99, [99]
    object_state.restore()
    out["object"] = (object_state.epoch, object_state.seen)
    return out


def _v1_data(rank: int, passes: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    return (rng.normal(size=(passes, 4, 3)).astype("float32"),
            rng.normal(size=(passes, 4, 1)).astype("float32"))


def v1_aggregation(passes: int = 2, updates: int = 2):
    """A tf.compat.v1 optimizer with backward_passes_per_step: ranks x passes of 4 samples
    against one process on the whole batch, eagerly and inside tf.function, averaged and
    summed; global_step counts every pass."""
    import tensorflow as tf

    import hora.tensorflow as hvd

    rank, size = hvd.rank(), hvd.size()
    every = [_v1_data(r, passes * updates) for r in range(size)]
    x, y = every[rank]
    out = {}
    for mode in ("eager", "graph"):
        for average in (True, False):
            w = tf.Variable(np.ones((3, 1), "float32"))
            step = tf.Variable(0, dtype=tf.int64)
            opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                           backward_passes_per_step=passes,
                                           average_aggregated_gradients=average)

            def train(xb, yb, w=w, step=step, opt=opt):
                def loss():
                    return tf.reduce_mean(tf.square(tf.matmul(xb, w) - yb))
                grads = opt.compute_gradients(loss, var_list=[w])
                opt.apply_gradients(grads, global_step=step)

            run = tf.function(train) if mode == "graph" else train
            seen = []
            for k in range(passes * updates):
                run(tf.constant(x[k]), tf.constant(y[k]))
                seen.append(w.numpy().copy())
            out[(mode, average)] = (seen, int(step.numpy()))
    # One process, one update per `passes` passes, on every rank's samples at once.
    for average in (True, False):
        w = tf.Variable(np.ones((3, 1), "float32"))
        alone = tf.compat.v1.train.GradientDescentOptimizer(0.1 if average else 0.1 * passes)
        for u in range(updates):
            xs = np.concatenate([every[r][0][u * passes + p] for r in range(size)
                                 for p in range(passes)])
            ys = np.concatenate([every[r][1][u * passes + p] for r in range(size)
                                 for p in range(passes)])
            alone.minimize(lambda xs=xs, ys=ys, w=w: tf.reduce_mean(
                tf.square(tf.matmul(xs, w) - ys)), var_list=[w])
        out[("alone", average)] = w.numpy()
    return out


def helpers():
    """Horovod's semi-public helpers through the import shim, and which names it lacks."""
    import importlib

    from hora._compat import shim_path

    sys.path.insert(0, shim_path())
    import horovod.keras as hkeras
    import horovod.runner.common.util.env as env
    import horovod.tensorflow as htf
    import horovod.tensorflow.util as util
    import horovod.torch as htorch
    import tensorflow as tf

    missing = [f"{module}.{name}" for module, names in HOROVOD_NAMES.items()
               for name in names if not hasattr(importlib.import_module(module), name)]
    in_graph = tf.function(lambda: tf.constant(htf._executing_eagerly()))()
    subset = htorch.add_process_set([0, htorch.size() - 1])
    ids = (htorch._get_process_set_ids_and_ranks(), htf._get_process_set_ids_and_ranks())
    htorch.remove_process_set(subset)
    after = htorch._get_process_set_ids_and_ranks()
    # Horovod's Keras collectives take tensor-compatible values, and the name second.
    rank, size = htorch.rank(), htorch.size()
    keras_ops = (float(hkeras.allreduce(float(rank), "keras.mean").numpy()),
                 hkeras.reducescatter(np.full((size, 2), rank + 1.0), "keras.rs",
                                      htf.Sum).numpy().tolist())
    return {"missing": missing, "eager": htf._executing_eagerly(), "keras_ops": keras_ops,
            "util_eager": util._executing_eagerly(), "in_graph": bool(in_graph.numpy()),
            "env": env.get_env_rank_and_size(), "ids": ids, "after": after,
            "average_fn": htf.handle_average_backwards_compatibility(None, False) == htf.Sum}


def lr_callbacks(steps: int = 4, epochs: int = 3):
    """What the optimizer holds during every batch under the schedule and warmup callbacks
    (a recorder callback listed after them), and whether momentum correction changes the
    trained weights."""
    import tensorflow as tf

    import hora.tensorflow.keras as hvd

    keras = tf.keras
    legacy = not _keras3()
    sgd = keras.optimizers.legacy.SGD if legacy else keras.optimizers.SGD

    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.during, self.after = [], []

        def on_train_batch_begin(self, batch, logs=None):
            opt = self.model.optimizer
            self.during.append((float(np.asarray(opt.learning_rate)),
                                float(np.asarray(opt.momentum))))

        def on_train_batch_end(self, batch, logs=None):
            self.after.append(float(np.asarray(self.model.optimizer.momentum)))

    x = np.random.default_rng(hvd.rank()).normal(size=(steps * 2, 3)).astype("float32")
    y = np.ones((steps * 2, 2), "float32")
    out = {}
    for name, make in (
            ("schedule", lambda correct: hvd.callbacks.LearningRateScheduleCallback(
                0.1, 0.5, start_epoch=1, momentum_correction=correct)),
            ("warmup", lambda correct: hvd.callbacks.LearningRateWarmupCallback(
                0.1, warmup_epochs=2, momentum_correction=correct))):
        weights = {}
        for correct in (True, False):
            model = _dense_model()
            model.compile(optimizer=sgd(0.1, momentum=0.9), loss="mse")
            recorder = Recorder()
            model.fit(x, y, batch_size=2, epochs=epochs, shuffle=False, verbose=0,
                      callbacks=[make(correct), recorder])
            weights[correct] = [w.copy() for w in model.get_weights()]
            if correct:
                out[name] = (recorder.during, recorder.after)
        out[(name, "weights_differ")] = any(not np.allclose(a, b) for a, b in
                                           zip(weights[True], weights[False], strict=True))
    out["legacy"] = legacy
    return out


def keras_aggregation():
    """tf-keras optimizers (new and legacy) with backward_passes_per_step=2: N ranks x 2
    passes against one process on the whole batch, as tf_scenarios.keras_equality checks
    Keras 3; summed passes (Horovod's default) equal one process at twice the rate."""
    import tensorflow as tf
    from sklearn.datasets import load_digits

    import hora.tensorflow.keras as hvd

    keras = tf.keras
    rank, size = hvd.rank(), hvd.size()
    local_batch, samples = 8, 192
    digits = load_digits()
    x = (digits.data[:samples] / 16.0).astype("float32")
    y = digits.target[:samples].astype("int64")
    batch = local_batch * size
    samples = samples // (2 * batch) * (2 * batch)
    x, y = x[:samples], y[:samples]
    mine = np.concatenate([np.arange(k * batch + rank * local_batch,
                                     k * batch + (rank + 1) * local_batch)
                           for k in range(samples // batch)])

    def model():
        keras.utils.set_random_seed(1234)
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="tanh"),
                                 keras.layers.Dense(10)])

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out = {}
    kinds = {"new": keras.optimizers.SGD}
    if not _keras3():
        kinds["legacy"] = keras.optimizers.legacy.SGD
    for kind, sgd in kinds.items():
        for average in (True, False):
            distributed = model()
            distributed.compile(optimizer=hvd.DistributedOptimizer(
                sgd(0.1), backward_passes_per_step=2, average_aggregated_gradients=average),
                loss=loss)
            distributed.fit(x[mine], y[mine], batch_size=local_batch, epochs=1,
                            shuffle=False, verbose=0)
            alone = model()
            alone.compile(optimizer=sgd(0.1 if average else 0.2), loss=loss)
            alone.fit(x, y, batch_size=2 * batch, epochs=1, shuffle=False, verbose=0)
            out[(kind, average)] = (distributed.get_weights(), alone.get_weights(),
                                    int(distributed.optimizer.iterations.numpy()))
    out["initial"] = model().get_weights()
    out["steps"] = samples // batch
    return out


def _each(**parts):
    """Every part's result, or the error it raised (as ``{"error": ...}``), so that one
    missing piece fails its own test and not the others'."""
    out = {}
    for name, part in parts.items():
        try:
            out[name] = part()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def keras3():
    """Everything, on Keras 3 (tf.keras in TensorFlow 2.16+): one TensorFlow import."""
    return _each(broadcast=broadcast_callback, partial=partial_optimizer,
                 elastic=elastic_states, v1=v1_aggregation, helpers=helpers, lr=lr_callbacks,
                 aggregation=keras_aggregation)


def legacy():
    """The Keras parts again on tf-keras (TF_USE_LEGACY_KERAS=1)."""
    return _each(broadcast=broadcast_callback, partial=partial_optimizer,
                 elastic=elastic_states, lr=lr_callbacks, aggregation=keras_aggregation)
