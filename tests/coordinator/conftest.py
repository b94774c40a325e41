"""Fixtures of the coordinator's gRPC tests: one coordinator process per module."""

from __future__ import annotations

import pytest
from coordinator_clients import Client
from support.coordinator import CoordinatorProcess


@pytest.fixture(scope="module")
def shared():
    """One coordinator for the module; every test uses its own job id."""
    with CoordinatorProcess(["--lease-s", "30"]) as proc:
        yield proc
        proc.stop()
        proc.dump_log()  # shown with -s, or in the report when the last test failed


@pytest.fixture
def client(shared):
    c = Client(shared.grpc_address, shared.token)
    yield c
    c.close()
