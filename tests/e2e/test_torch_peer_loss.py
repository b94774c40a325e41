"""A handle the engine holds in the data plane when a peer dies completes with the error.

Two real workers (a real coordinator, real Gloo): rank 1 SIGKILLs itself once its
engine is inside the data-plane call of an asynchronous allreduce
(tests/e2e/torch_peer_loss_worker.py). Rank 0 waits with ``hvd.poll`` only, which
reads the handle and never the engine's failure: the handle must turn complete,
and ``synchronize`` must raise ``HorovodInternalError`` (what elastic resets on).
Both paths: the tensor negotiated through the coordinator, and the same tensor
cached (agreed peer to peer). Before the fix poll stayed False for ever: failing
the generation completed only the tensors still in the pending table.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.coordinator import CoordinatorProcess
from tests.support.workers import collect, describe, start_workers

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SCENARIO = Path(__file__).with_name("torch_peer_loss_worker.py")
ENV = {"HORA_COLLECTIVE_TIMEOUT": "30"}


@pytest.mark.parametrize("cached", [False, True], ids=["negotiated", "cached"])
def test_a_held_handle_completes_with_the_error_when_its_peer_dies(tmp_path, cached):
    with CoordinatorProcess(["--lease-s", "10"]) as coordinator:
        # A cached tensor goes through Gloo after its round (one host otherwise
        # shares it in memory, and a peer that dies then has already given it).
        env = {**ENV, "HORA_SHM_ALLREDUCE_BYTES": "0", "HORA_MESH_ALLREDUCE_BYTES": "0"}
        procs = start_workers(coordinator, 2, SCENARIO, "poll_when_peer_dies", (1, cached),
                              env=env if cached else ENV, tmpdir=tmp_path)
        results = collect(procs, timeout=200)
    survivor, victim = results
    assert victim.returncode == -9, describe(results)
    assert survivor.error_type is None, describe(results)
    report = survivor.value
    assert report["warm"] == [3.0] * 4, report
    assert report["how"] == "completed", (report, describe(results))
    assert "HorovodInternalError" in report.get("error", []), report
