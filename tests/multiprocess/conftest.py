"""Fixtures for multi-process tests: one real coordinator process per module."""

from __future__ import annotations

import pytest

from tests.support.coordinator import CoordinatorProcess


@pytest.fixture(scope="module")
def shared_coordinator():
    """A coordinator shared by the tests of a module; each test runs its own job in it."""
    with CoordinatorProcess(["--lease-s", "3"]) as coordinator:
        yield coordinator
