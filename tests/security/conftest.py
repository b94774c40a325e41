"""tests/security: attacks tried as a stranger or a token holder would.

Most need root and network namespaces; :func:`netns_root` skips, loudly and
with the reason, where the machine cannot make them. Keep this file generic:
several test files share it.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def netns_missing() -> str | None:
    """Why this machine cannot run namespace tests, or None when it can."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "no 'ip' tool (iproute2)"
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        return f"'ip netns' does not work here: {done.stderr.strip()}"
    return None


@pytest.fixture(scope="session")
def netns_root() -> None:
    """Skips the test when it cannot run as root in network namespaces."""
    why = netns_missing()
    if why is not None:
        pytest.skip(f"!!! SKIPPED security test needing root and network namespaces: {why} !!!")
