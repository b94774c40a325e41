"""The cluster suites' last words: one loud line per suite skipped, and their timings
(after pytest's own summary, so that a `make test` without Ray or Java ends on it)."""

from __future__ import annotations

import pytest
from cluster_report import RESULTS, SKIPPED, TIMINGS


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    if TIMINGS:
        reporter.write_line("cluster tests measured: " + ", ".join(
            f"{k} {v:.1f} s" for k, v in TIMINGS.items()))
    for name, what in RESULTS.items():
        reporter.write_line(f"cluster tests reached: {name}: {what}")
    for reason in SKIPPED.values():
        reporter.write_line(f"!!!!! {reason} !!!!!", red=True, bold=True)
