"""Keras training-step throughput: hora's DistributedOptimizer against TensorFlow's own
``tf.distribute.MultiWorkerMirroredStrategy``, on the same model and 2 processes.

    python bench/keras_step.py

One step is ``model.fit``'s train step (forward, backward, SGD with momentum)
on a fixed synthetic batch of 64 per process, with tf-keras (the Keras that
supports that strategy in ``fit``) for both. hora runs under ``horarun`` with
``hora.tensorflow.keras.DistributedOptimizer``; the baseline is two plain
processes that meet through ``TF_CONFIG`` and reduce the gradients with
TensorFlow's collective ops (ring, over gRPC). Skipped, with one line, when
TensorFlow is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
from common import HORA, SETTINGS, fmt, ratio

MWMS = "tf-mwms"
BATCH = 64
RANKS = 2
WARMUP = 5 if SETTINGS.quick else 10
REPS = 2 if SETTINGS.quick else 3
STEPS_PER_REP = 10 if SETTINGS.quick else 30
ROUNDS = 1 if SETTINGS.quick else 2
MODELS = {"mlp": (784, [1024, 1024], 10), "small mlp": (64, [64], 10)}
# Legacy Keras (tf-keras) for both: Keras 3's fit cannot take MultiWorkerMirroredStrategy's
# distributed datasets here (TF 2.21, Keras 3.15: "Attempt to convert a value (PerReplica...)").
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": "1",
          "TF_NUM_INTEROP_THREADS": "2", "TF_USE_LEGACY_KERAS": "1"}


def build(tf, name: str):
    inputs, hidden, classes = MODELS[name]
    layers = [tf.keras.Input((inputs,))]
    layers += [tf.keras.layers.Dense(width, activation="relu") for width in hidden]
    layers.append(tf.keras.layers.Dense(classes))
    return tf.keras.Sequential(layers)


def worker(system: str, out: str) -> None:
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    if system == HORA:
        import hora.tensorflow.keras as hvd

        hvd.init()
        rank = hvd.rank()
        strategy = None
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    result = {}
    for name in MODELS:
        inputs = MODELS[name][0]
        rng = np.random.default_rng(rank)
        x = rng.standard_normal((BATCH, inputs)).astype("float32")
        y = rng.integers(0, MODELS[name][2], BATCH).astype("int64")
        loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        if strategy is None:
            tf.keras.utils.set_random_seed(0)
            model = build(tf, name)
            model.compile(optimizer=hvd.DistributedOptimizer(
                tf.keras.optimizers.SGD(0.01 * RANKS, momentum=0.9)), loss=loss)
            data = tf.data.Dataset.from_tensors((x, y)).repeat()
        else:
            with strategy.scope():
                tf.keras.utils.set_random_seed(0)
                model = build(tf, name)
                model.compile(optimizer=tf.keras.optimizers.SGD(0.01 * RANKS, momentum=0.9),
                              loss=loss)
            # The global batch: each worker's replica gets BATCH of it (no sharding of
            # a synthetic batch that every worker holds).
            options = tf.data.Options()
            options.experimental_distribute.auto_shard_policy = \
                tf.data.experimental.AutoShardPolicy.OFF
            data = tf.data.Dataset.from_tensors(
                (np.concatenate([x] * RANKS), np.concatenate([y] * RANKS))).repeat() \
                .with_options(options)
        model.fit(data, steps_per_epoch=WARMUP, epochs=1, verbose=0)
        times = []
        for _ in range(REPS):
            start = time.perf_counter()
            model.fit(data, steps_per_epoch=STEPS_PER_REP, epochs=1, verbose=0)
            times.append((time.perf_counter() - start) / STEPS_PER_REP)
        result[name] = {"step": times,
                        "params": int(sum(np.prod(w.shape) for w in model.get_weights()))}
    common.write_result(out, rank, result)
    if strategy is None:
        hvd.shutdown()


def launch_mwms() -> common.LaunchResult:
    """Two plain processes of this script, meeting through TF_CONFIG on loopback."""
    out_dir = Path(tempfile.mkdtemp(prefix="hora-bench-mwms-"))
    ports = [common.free_port() for _ in range(RANKS)]
    workers = [f"127.0.0.1:{p}" for p in ports]
    start = time.perf_counter()
    procs = []
    logs = []
    for rank in range(RANKS):
        config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}
        env = {**os.environ, **common.THREAD_ENV, **TF_ENV, "TF_CONFIG": json.dumps(config)}
        log = tempfile.TemporaryFile("w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", MWMS, "--out", str(out_dir)], env=env,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + SETTINGS.launch_timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wall = time.perf_counter() - start
    ranks, error = [], ""
    try:
        ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(RANKS)]
    except (OSError, ValueError) as exc:
        logs[0].seek(0)
        error = f"{type(exc).__name__}: {exc}"
        common.log(f"{MWMS} FAILED ({error}); output tail:\n{logs[0].read()[-2000:]}")
    for log in logs:
        log.close()
    common.log(f"{MWMS} np={RANKS}: {wall:.1f} s")
    return common.LaunchResult(MWMS, RANKS, ranks, wall, error)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", choices=[HORA, MWMS])
    parser.add_argument("--out", help="directory for rank{R}.json (worker mode)")
    ns = parser.parse_args()
    if ns.worker:
        worker(ns.worker, ns.out)
        return
    title = f"3c. Keras training step, {RANKS} processes, batch {BATCH} per process"
    if importlib.util.find_spec("tensorflow") is None or \
            importlib.util.find_spec("tf_keras") is None:
        common.emit(f"## {title}\n\n_not measured: TensorFlow or tf-keras is not "
                    f"installed (pip install 'hora[tensorflow]')_\n")
        return
    os.environ.update(TF_ENV)
    runs: dict[str, list[common.LaunchResult]] = {HORA: [], MWMS: []}
    for _ in range(ROUNDS):  # interleaved, so that outside load lands on both alike
        runs[HORA].append(common.launch(HORA, __file__, RANKS))
        runs[MWMS].append(launch_mwms())

    def throughput(system: str, model: str) -> float | None:
        samples = common.pooled(runs[system], lambda r: r[model]["step"])
        return BATCH * RANKS / common.median(samples) if samples else None

    rows = []
    for model in MODELS:
        info = next((r.rank0[model] for rs in runs.values() for r in rs if r.ok), {})
        params = common.MISSING if not info else (
            f"{info['params'] / 1e6:.2f}M" if info["params"] >= 100_000 else str(info["params"]))
        hora, mwms = throughput(HORA, model), throughput(MWMS, model)
        rows.append([f"Keras {model}", params, fmt(hora, 0), fmt(mwms, 0), ratio(hora, mwms)])
    failures = [r for rs in runs.values() for r in rs if not r.ok]
    common.emit(common.section(
        title,
        common.table(["model", "params", "hora samples/s",
                      "MultiWorkerMirroredStrategy samples/s", "hora/MWMS"], rows),
        [f"Samples/s over both processes, from the median step time of {REPS} `fit` calls "
         f"of {STEPS_PER_REP} steps after {WARMUP} warm-up steps, in each of {ROUNDS} "
         "interleaved launches per system. hora: `horarun -np 2`, "
         "`hora.tensorflow.keras.DistributedOptimizer`; MWMS: TensorFlow's collective "
         "all-reduce between 2 processes (TF_CONFIG on loopback). Both on tf-keras "
         "(TF_USE_LEGACY_KERAS=1). Target: hora/MWMS >= 1.0."],
        failures, compares_horovod=False))


if __name__ == "__main__":
    main()
