"""What the cluster suites tell the end of the run: the suites skipped, and why, and
what they measured (printed by this folder's conftest.py)."""

from __future__ import annotations

SKIPPED: dict[str, str] = {}
TIMINGS: dict[str, float] = {}
# What the runs reached (accuracies, final worlds), as the examples printed it.
RESULTS: dict[str, str] = {}
