"""A TensorFlow graph op pending in an engine that shuts down fails; it never hangs.

In a world of one (a real engine, hora's real op library, dispatcher and
completer), a ``tf.function`` runs a graph op whose engine handle no stage will
complete (what a tensor taken for the data plane becomes when the data plane
breaks under it). ``hvd.shutdown()`` from another thread must fail the op, with
the engine's HorovodInternalError behind TensorFlow's error, and a graph op
started after the shutdown must fail at once. Each script runs in its own
process, with a deadline: before the fix the op waited forever.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("TensorFlow is not installed", allow_module_level=True)

pytestmark = pytest.mark.timeout(200)

SCRIPT = textwrap.dedent("""
    import os, threading, time
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np
    import tensorflow as tf
    import hora.tensorflow as hvd
    from hora import world
    from hora.engine import Handle
    from hora.tensorflow import _graph_ops
    from hora.tensorflow.mpi_ops import engine_error

    hvd.init()
    started = threading.Event()

    def never_completed(*arrays):
        started.set()
        return world.register(Handle("lost")), lambda result: [np.asarray(result)]

    @tf.function
    def step(x):
        return _graph_ops.graph_op(never_completed, [x], [tf.float32], None)[0]

    outcome = []

    def run():
        try:
            outcome.append(("returned", step(tf.ones([2])).numpy()))
        except Exception as exc:
            outcome.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(60), "the op never reached the dispatcher"
    hvd.shutdown()
    thread.join(30)
    assert outcome, "the pending graph op hung after hvd.shutdown()"
    how, exc = outcome[0]
    assert how == "raised", outcome
    behind = engine_error(exc)
    assert isinstance(behind, hvd.HorovodInternalError), (type(exc), exc, behind)
    assert "shut down" in str(behind), behind
    print("pending op failed:", type(exc).__name__, "behind:", type(behind).__name__)

    # A graph op submitted after the shutdown fails at once (it never waits).
    @tf.function
    def after(x):
        return hvd.allreduce(x, name="after")

    began = time.monotonic()
    try:
        after(tf.ones([2]))
    except Exception as exc:
        print("after shutdown:", type(exc).__name__, round(time.monotonic() - began, 2), "s")
    else:
        raise AssertionError("a graph op after hvd.shutdown() returned")
    os._exit(0)  # (TensorFlow's exit is slow; everything is checked)
""")


def test_a_pending_graph_op_fails_when_its_engine_shuts_down(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    assert "pending op failed: " in done.stdout, done.stdout
    assert "after shutdown: " in done.stdout, done.stdout
