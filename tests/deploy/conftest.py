"""The deployment tests' end-of-run lines: one loud line per part skipped, and timings."""

from __future__ import annotations

import pytest
from deploy_tools import SKIPPED, TIMINGS


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter) -> None:
    if TIMINGS:
        terminalreporter.write_line(
            "deployment tests took: " + ", ".join(f"{k} {v:.1f} s" for k, v in TIMINGS.items()))
    for reason in SKIPPED.values():
        terminalreporter.write_line(f"!!!!! {reason} !!!!!", red=True, bold=True)
