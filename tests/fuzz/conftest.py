"""Fixtures of the fuzz tests: one fuzzed coordinator per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fuzz_target import FUZZ_FLAGS, FuzzTarget
from support.coordinator import CoordinatorProcess


@pytest.fixture(scope="module")
def fuzz_target() -> Iterator[FuzzTarget]:
    """A coordinator process of its own for the module's fuzzers (log shown on failure)."""
    with CoordinatorProcess(FUZZ_FLAGS) as proc:
        yield FuzzTarget(proc)
        proc.stop()
        proc.dump_log()  # pytest shows teardown output only when a test failed
