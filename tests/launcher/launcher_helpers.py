"""Constants and helpers shared by the launcher tests.

A module of its own, not conftest.py: ``import conftest`` would be ambiguous
once other test folders have theirs.
"""

from __future__ import annotations

import os
import shlex
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


class Discovery:
    """A host discovery script whose output the test rewrites at will.

    Attributes:
        script: the command for ``--host-discovery-script``.
    """

    def __init__(self, directory: Path) -> None:
        self._hosts = directory / "discovered_hosts"
        self._hosts.write_text("")
        path = directory / "discover.sh"
        path.write_text(f"#!/bin/sh\nexec cat {shlex.quote(str(self._hosts))}\n")
        path.chmod(0o755)
        self.script = str(path)

    def set_hosts(self, *lines: str) -> None:
        """What the script prints from its next run on, one line per item."""
        # Replaced atomically, so the script never reads a half-written list.
        tmp = self._hosts.with_suffix(".tmp")
        tmp.write_text("".join(f"{line}\n" for line in lines))
        tmp.replace(self._hosts)
