"""Elastic recovery: from a kill -9 of one of 3 workers to the first completed step after it.

    python bench/elastic_recovery.py     # driver: prints the markdown table

Runs ``horarun`` in elastic mode (3 workers on the loopback hosts 127.0.0.2-4,
min 2, max 3) with the elastic test worker (tests/e2e/elastic_worker.py),
which commits after every step. Rank 2 records the time and kills itself
with SIGKILL mid-epoch; the survivors log the wall time of every step. The
recovery time is the first survivor step that completes after the kill,
minus the kill time: it covers the failure notice, the restore of the last
commit, the new rendezvous, the new Gloo process group and the state sync.
Target: under 5 s on this machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import common

WORKER = common.BENCH_DIR.parent / "tests" / "e2e" / "elastic_worker.py"
REPEATS = 1 if common.SETTINGS.quick else 3
TARGET_S = 5.0


def one_run() -> float | None:
    with tempfile.TemporaryDirectory(prefix="hora-bench-elastic-") as tmp:
        tmp_path = Path(tmp)
        hosts = tmp_path / "discover.sh"  # three loopback "hosts" of one slot each
        hosts.write_text("#!/bin/sh\nprintf '127.0.0.2:1\\n127.0.0.3:1\\n127.0.0.4:1\\n'\n")
        hosts.chmod(0o755)
        out = tmp_path / "out"
        out.mkdir()
        cmd = [sys.executable, "-m", "hora.runner.launch", "-np", "3", "--min-np", "2",
               "--max-np", "3", "--host-discovery-script", str(hosts),
               sys.executable, str(WORKER), str(out), "--kill-rank", "2", "--kill-step", "8",
               "--epochs", "2", "--step-sleep", "0.01"]
        env = {**os.environ, **common.THREAD_ENV, "PYTHONUNBUFFERED": "1"}
        try:
            subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env,
                           check=False)
        except subprocess.TimeoutExpired:
            return None
        kill_file = out / "kill.json"
        reports = [json.loads(p.read_text()) for p in out.glob("report.*.json")]
        if not kill_file.exists() or not reports:
            return None
        killed_at = json.loads(kill_file.read_text())["time"]
        # The first step finished by the re-formed world of 2 (a survivor's step
        # that raced the kill in the old world does not count).
        after = [t for r in reports for t, size in r["step_times"] if t > killed_at and size == 2]
        return min(after) - killed_at if after else None


def main() -> None:
    runs = [one_run() for _ in range(REPEATS)]
    done = [r for r in runs if r is not None]
    rows = [["kill -9 of 1 of 3 workers -> first step after",
             common.fmt(common.median(done) if done else None, 2),
             common.fmt(min(done) if done else None, 2),
             common.fmt(max(done) if done else None, 2), f"{TARGET_S:g}"]]
    notes = [f"{len(done)} of {len(runs)} runs measured; seconds from the SIGKILL to the "
             f"first training step completed by a survivor (restore, re-rendezvous, new "
             f"process group and state sync included). Survivors are never restarted."]
    common.emit(common.section("5. elastic recovery at 3 ranks (hora only)",
                               common.table(["measurement", "median s", "min s", "max s",
                                             "target s"], rows), notes,
                               compares_horovod=False))


if __name__ == "__main__":
    main()
