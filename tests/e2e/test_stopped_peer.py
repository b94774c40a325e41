"""A stopped (not dead) peer: its TCP connections stay open, yet survivors must not hang.

A SIGSTOPped worker answers nothing but closes nothing: the mesh's sockets
to it stay open, so only its coordinator lease running out tells the others.
When it does, every wait on the data plane must end at once: the survivors'
calls raise, ``hvd.shutdown()`` returns promptly, and their processes exit,
long before the 300 s collective timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

HORARUN = [sys.executable, "-m", "hora.runner.launch"]
# The embedded coordinator's lease is 2 s (10 s before leases were sized to the
# load); the rest is slack for a busy machine.
DEADLINE_S = 30.0

WORKER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    import torch
    import hora.torch as hvd
    from hora import _runtime

    out = Path(sys.argv[1])
    hvd.init()
    rank = hvd.rank()
    (out / f"{rank}.pid").write_text(str(os.getpid()))
    x = torch.ones(4)
    step = 0
    try:
        while True:
            y = hvd.allreduce(x, name="grad", op=hvd.Sum)
            assert y[0].item() == hvd.size(), y
            step += 1
            if step == 30:
                mesh = _runtime.current().engine.mesh_batches
                (out / f"{rank}.running").write_text(str(mesh))
    except Exception as exc:
        (out / f"{rank}.raised").write_text(json.dumps({
            "at": time.time(), "type": type(exc).__name__,
            "mro": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}))
        started = time.monotonic()
        hvd.shutdown()
        (out / f"{rank}.shutdown").write_text(str(time.monotonic() - started))
        sys.exit(3)
""")


def pid_gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (absent, or a zombie awaiting its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wait_for(what: str, check, deadline: float, proc: subprocess.Popen) -> None:
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        if proc.poll() is not None:
            raise AssertionError(f"horarun exited ({proc.returncode}) while waiting for "
                                 f"{what}:\n{proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.05)


@pytest.mark.parametrize("victim", [2, 0], ids=["highest-rank", "rank-0"])
def test_survivors_of_a_stopped_peer_raise_and_exit_within_the_lease(tmp_path: Path,
                                                                     victim: int):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([*HORARUN, "-np", "3", sys.executable, str(script), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env=env)
    stopped = None
    try:
        wait_for("every rank to run", lambda: len(list(tmp_path.glob("*.running"))) == 3,
                 time.monotonic() + 90, proc)
        assert all(int(p.read_text()) > 0 for p in tmp_path.glob("*.running")), \
            "the mesh carried no data: this test would not exercise it"
        pids = {r: int((tmp_path / f"{r}.pid").read_text()) for r in range(3)}
        survivors = [r for r in range(3) if r != victim]
        stopped = pids[victim]
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.time()
        wait_for("the survivors to exit",
                 lambda: all(pid_gone(pids[r]) for r in survivors),
                 time.monotonic() + DEADLINE_S, proc)
        for rank in survivors:
            report = json.loads((tmp_path / f"{rank}.raised").read_text())
            assert "HorovodInternalError" in report["mro"], report
            assert report["at"] - stopped_at < DEADLINE_S, report
        shutdowns = [float(p.read_text()) for p in tmp_path.glob("*.shutdown")]
        assert shutdowns, "no survivor finished hvd.shutdown()"
        assert all(s < 5.0 for s in shutdowns), shutdowns
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGKILL)
            os.kill(stopped, signal.SIGCONT)
        try:
            _out, stderr = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode != 0, stderr
