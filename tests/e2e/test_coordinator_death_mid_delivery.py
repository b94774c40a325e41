"""No step stranded by a coordinator that dies mid-delivery (issue 28, item 3).

The coordinator's test-only hook (``--test-die-after-list N``) makes it exit
right after it has written the global set's response list number N to rank
0's stream, before rank 1's stream got it. Rank 0 then runs the collective;
rank 1 still waits for the answer and sends its request again once it has
re-attached. The test restarts the coordinator on the same ports and state
dir: the re-attaching ranks report the lists they hold, and the coordinator
re-sends list N to rank 1. The step must complete long before the stall and
collective timeouts (120 s), and the parameters must be identical on both
ranks and equal to those of a run without the kill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_coordinator_restart import WORKER as RESTART_WORKER
from tests.e2e.test_coordinator_restart import restarted, step_of
from tests.support.coordinator import CoordinatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

HORARUN = [sys.executable, "-m", "hora.runner.launch"]
STEPS = 30
# The global set's lists: the parameter broadcast and step 0's gradients come
# first, then one list per step for the loss (a name never negotiated before).
DIE_AFTER_LIST = 16
# Set long, so that a stranded step shows as a failure, not a slow pass.
TIMEOUTS = {"HORA_STALL_SHUTDOWN_TIME": "120", "HORA_COLLECTIVE_TIMEOUT": "120",
            "HORA_COORDINATOR_OUTAGE_TIMEOUT": "120"}
# Well under those timeouts: the restart and the re-attach, on a loaded machine.
REATTACH_BOUND_S = 60

# The restart test's worker, asked for a new name every step: each step needs
# the coordinator, and the allreduced loss also moves a bias, so that the
# list that was re-sent decides the parameters too.
_CALL = 'hvd.allreduce(loss.detach(), name=f"loss.{step}")'
assert _CALL in RESTART_WORKER
WORKER = RESTART_WORKER.replace(_CALL, f"model[0].bias.data.add_(1e-3 * {_CALL})")


def run_job(tmp_path: Path, coord: CoordinatorProcess, name: str) -> subprocess.Popen:
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    out = tmp_path / name
    out.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HORA_TOKEN": coord.token, **TIMEOUTS}
    return subprocess.Popen(
        [*HORARUN, "-np", "2", "--coordinator", coord.grpc_address, "--job-id", name,
         sys.executable, str(script), str(out), str(STEPS), "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def results(tmp_path: Path, name: str, proc: subprocess.Popen, timeout: float) -> list[dict]:
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        raise AssertionError(f"job {name} did not finish:\n{stderr[-6000:]}") from None
    assert proc.returncode == 0, f"job {name} failed ({proc.returncode}):\n{stderr[-6000:]}"
    found = [json.loads((tmp_path / name / f"{rank}.json").read_text()) for rank in (0, 1)]
    for result in found:  # every step, in the process and generation it started in
        assert result["steps"] == STEPS
        assert result["pid"] == result["end_pid"]
        assert result["generation"] == result["end_generation"] == 1, result
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """The parameters the same job ends with when no coordinator dies."""
    tmp_path = tmp_path_factory.mktemp("reference")
    with CoordinatorProcess() as plain:
        found = results(tmp_path, "plain", run_job(tmp_path, plain, "plain"), 150)
    assert found[0]["digest"] == found[1]["digest"]
    return found[0]["digest"]


@pytest.mark.parametrize("journal", [True, False], ids=["state-dir", "no-state-dir"])
def test_a_list_delivered_to_rank_0_only_is_redelivered_after_the_restart(
        tmp_path, reference, journal):
    extra = ["--state-dir", str(tmp_path / "state")] if journal else []
    first = CoordinatorProcess([*extra, "--test-die-after-list", str(DIE_AFTER_LIST)]).start()
    coordinators = [first]
    try:
        proc = run_job(tmp_path, first, "killed")
        assert first.proc is not None
        first.proc.wait(120)  # the hook's exit, mid-training
        died = time.monotonic()
        assert "test hook: exiting after delivering response list" in first.log(), first.log()
        assert first.proc.returncode == 70
        at_death = [step_of(tmp_path / "killed", r) for r in (0, 1)]
        assert max(at_death) < STEPS - 1, at_death
        second = restarted(first, extra).start()
        coordinators.append(second)
        # Every step after the death completes well before the 120 s timeouts.
        deadline = died + REATTACH_BOUND_S
        while min(step_of(tmp_path / "killed", r) for r in (0, 1)) <= max(at_death):
            assert proc.poll() is None, proc.communicate()[1][-6000:]
            assert time.monotonic() < deadline, (
                f"the step after the coordinator died is still stranded after "
                f"{REATTACH_BOUND_S} s (steps {at_death} at the death)")
            time.sleep(0.1)
        found = results(tmp_path, "killed", proc, 150)
        assert "redelivered" in second.log(), second.log()
        assert found[0]["digest"] == found[1]["digest"], "the ranks' parameters differ"
        assert found[0]["digest"] == reference, "the kill changed the result"
        assert "Traceback" not in second.log(), second.log()
    except BaseException:
        for coordinator in coordinators:
            coordinator.dump_log()
        raise
    finally:
        for coordinator in coordinators:
            coordinator.stop()
