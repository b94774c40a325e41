"""A TensorFlow graph op whose peer dies mid-collective fails; it never hangs.

Two real workers (a real coordinator, real Gloo, hora's ``HoraCollective`` op
library) run a ``tf.function`` allreduce; rank 1 SIGKILLs itself once its engine
is inside the data-plane call for it (tests/e2e/tf_graph_peer_loss_worker.py), so
rank 0's engine is blocked in the same call, with the tensor already taken out of
its pending table. Rank 0's graph op must raise within the scenario's deadline,
with the engine's error behind the ``OpError`` (what ``hvd.elastic.run`` resets
on), and the next graph op on the failed engine must fail too. Before the fix the
op waited forever for a done callback that never came (CI's elastic Keras hang).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.support.coordinator import CoordinatorProcess
from tests.support.workers import collect, describe, start_workers

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("TensorFlow is not installed", allow_module_level=True)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SCENARIO = Path(__file__).with_name("tf_graph_peer_loss_worker.py")
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTEROP_THREADS": "2",
       "TF_NUM_INTRAOP_THREADS": "1",
       # A bound on the data plane's own wait, so that a hang is the op's, not Gloo's.
       "HORA_COLLECTIVE_TIMEOUT": "30"}


def test_graph_op_fails_when_its_peer_is_killed_inside_the_collective(tmp_path):
    with CoordinatorProcess(["--lease-s", "10"]) as coordinator:
        procs = start_workers(coordinator, 2, SCENARIO, "graph_op_when_peer_dies", (1,),
                              env=ENV, tmpdir=tmp_path)
        results = collect(procs, timeout=200)
    survivor, victim = results
    assert victim.returncode == -9, describe(results)
    assert survivor.error_type is None, describe(results)
    report = survivor.value
    assert report["warm"] == [3.0] * 4, report
    assert report["how"] == "raised", (report, describe(results))
    # TensorFlow's OpError, with the engine's error behind it: elastic resets on it.
    assert "HorovodInternalError" in report["behind"], report
    assert report["next"] == "raised", report
