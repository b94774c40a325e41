"""Fixtures the unit tests of the mesh share."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A folder in /dev/shm for the test's segments, removed after it."""
    folder = tempfile.mkdtemp(prefix="hora-mesh-test-", dir="/dev/shm")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
