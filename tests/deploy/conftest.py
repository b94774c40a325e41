"""The deployment tests' last words: their timings, and one loud line per part skipped
(after pytest's own summary, so that a `make test` without Docker or kubectl ends on it)."""

from __future__ import annotations

import pytest
from deploy_tools import RESULTS, SKIPPED, TIMINGS


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    if TIMINGS:
        reporter.write_line(
            "deployment tests took: " + ", ".join(f"{k} {v:.1f} s" for k, v in TIMINGS.items()))
    if RESULTS:
        reporter.write_line(
            "deployment tests reached: " + "; ".join(f"{k}: {v}" for k, v in RESULTS.items()))
    for reason in SKIPPED.values():
        reporter.write_line(f"!!!!! {reason} !!!!!", red=True, bold=True)
