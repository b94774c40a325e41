"""Fixtures shared by every test folder. Append yours below; keep them general."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Test folders have no __init__.py; shared helpers import as `support.X` (tests/ is on
# sys.path through this conftest) or, for helper modules meant to be imported bare,
# from tests/support directly (e.g. `from workers import run_workers`).
_TESTS = Path(__file__).resolve().parent
for _path in (_TESTS, _TESTS / "support"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from support.coordinator import CoordinatorProcess  # noqa: E402
from support.netns import NetnsUnavailable, NetworkNamespace  # noqa: E402


@pytest.fixture
def coordinator_factory() -> Iterator[Callable[..., CoordinatorProcess]]:
    """Starts coordinators with custom flags; all are stopped after the test.

    ``coordinator_factory(*extra_args, token=None, env=None)`` returns a
    running :class:`CoordinatorProcess`. Their logs show in the report of a
    failed test.
    """
    started: list[CoordinatorProcess] = []

    def start(*extra_args: str, **kwargs) -> CoordinatorProcess:
        proc = CoordinatorProcess(extra_args, **kwargs)
        started.append(proc)
        return proc.start()

    yield start
    for proc in started:
        proc.stop()
        proc.dump_log()  # pytest shows teardown output only when the test failed


@pytest.fixture
def coordinator(coordinator_factory) -> CoordinatorProcess:
    """A running coordinator process with a 2 s lease."""
    return coordinator_factory("--lease-s", "2")


@pytest.fixture
def netns() -> Iterator[NetworkNamespace]:
    """A network namespace with a non-loopback address of its own (skips when none
    can be made: not root, no ``ip``). See :mod:`support.netns`."""
    namespace = NetworkNamespace()
    try:
        namespace.create()
    except NetnsUnavailable as exc:
        namespace.delete()
        pytest.skip(f"no network namespace: {exc}")
    yield namespace
    namespace.delete()
