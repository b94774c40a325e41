"""Worker functions for tests/e2e/test_tf_graph_peer_loss.py (run by tests/support/worker_main.py).

:func:`graph_op_when_peer_dies`: a ``tf.function`` allreduce (hora's asynchronous
``HoraCollective`` graph op) whose peer is SIGKILLed while this rank's engine is
inside the data-plane call for it. The engine had already taken the tensor out of
its pending table, so failing the generation did not complete the tensor's handle;
the graph op waited for that handle's done callback forever (the hang CI saw in
``test_elastic_keras_survives_kill_9_of_one_of_three_workers``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_plane_faults import die_in_the_data_plane  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

if __name__ == "scenario":  # in a worker: TensorFlow before hvd.init() (tf_scenarios.py)
    import tensorflow  # noqa: F401

# How long the survivor's graph op may take to fail once its peer is gone. The peer's
# death reaches the survivor in well under a second (its sockets close); the rest is
# slack for a loaded machine. A hang reports "hung" at this deadline.
DEADLINE_S = 60.0


def _in_thread(call, deadline: float) -> tuple[str, object]:  # type: ignore[no-untyped-def]
    """("returned", value), ("raised", exception) or ("hung", None) after ``deadline`` s."""
    outcome: list[tuple[str, object]] = []

    def run() -> None:
        try:
            outcome.append(("returned", call()))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            outcome.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(deadline)
    return outcome[0] if outcome else ("hung", None)


def graph_op_when_peer_dies(victim: int) -> dict:
    import tensorflow as tf

    import hora.tensorflow as hvd
    from hora.tensorflow.mpi_ops import engine_error

    x = tf.ones([4], tf.float32) * (hvd.rank() + 1)

    @tf.function
    def step(tensor):  # type: ignore[no-untyped-def]
        return hvd.allreduce(tensor, name="victim", op=hvd.Sum)

    @tf.function
    def warm(tensor):  # type: ignore[no-untyped-def]
        return hvd.allreduce(tensor, name="warm", op=hvd.Sum)

    # The op library is built and the graph path works before anyone dies.
    warmed = warm(x).numpy().tolist()
    if hvd.rank() == victim:
        die_in_the_data_plane("victim", delay=1.0)
    started = time.monotonic()
    how, what = _in_thread(lambda: step(x).numpy().tolist(), DEADLINE_S)
    report: dict = {"warm": warmed, "how": how, "seconds": time.monotonic() - started}
    if how == "hung":  # what the engine knew meanwhile, for the failure message
        from hora import _runtime

        engine = _runtime.current().engine
        report.update(failure=repr(engine.failure()),
                      still_pending=sorted(engine._pending.entries))
    if how == "raised":
        assert isinstance(what, BaseException)
        behind = engine_error(what)
        report.update(error=type(what).__name__, message=str(what)[:500],
                      behind=[c.__name__ for c in type(behind).__mro__] if behind else [])
        # The failed engine refuses the next graph op at once (it fails, never waits).
        again, after = _in_thread(lambda: warm(x).numpy().tolist(), DEADLINE_S)
        report["next"] = again
        report["next_error"] = type(after).__name__ if again == "raised" else None
    return report
