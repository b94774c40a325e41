"""Constants and helpers shared by the launcher tests.

A module of its own, not conftest.py: ``import conftest`` would be ambiguous
once other test folders have theirs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The module form needs no console script on PATH and uses this interpreter.
HORARUN = [sys.executable, "-m", "hora.runner.launch"]
# A coordinator address nobody listens on: for tests whose workers never
# call hvd.init(), so no coordinator is embedded.
NO_COORDINATOR = ["--coordinator", "127.0.0.1:1"]


def pid_gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (absent, or a zombie awaiting its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"
