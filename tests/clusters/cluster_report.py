"""What the cluster suites tell the end of the run: the suites skipped, and why, and
what they measured (printed by this folder's conftest.py)."""

from __future__ import annotations

SKIPPED: dict[str, str] = {}
TIMINGS: dict[str, float] = {}
