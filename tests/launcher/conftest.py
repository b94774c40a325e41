"""Fixtures for the launcher tests: write worker scripts and host discovery
scripts, run ``horarun`` for real."""

from __future__ import annotations

import subprocess
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from launcher_helpers import HORARUN, Discovery


@pytest.fixture
def worker_script(tmp_path: Path) -> Callable[[str], str]:
    """Writes a worker script into ``tmp_path`` and returns its path."""
    counter = iter(range(1000))

    def write(source: str) -> str:
        path = tmp_path / f"worker_{next(counter)}.py"
        path.write_text(textwrap.dedent(source))
        return str(path)

    return write


@pytest.fixture
def horarun() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Runs ``horarun ARGS`` to completion and returns its result (text)."""

    def run(args: Sequence[str], timeout: float = 30.0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*HORARUN, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            stdin=subprocess.DEVNULL,
        )

    return run


@pytest.fixture
def discovery(tmp_path: Path) -> Discovery:
    """A discovery script in ``tmp_path`` printing nothing until told otherwise."""
    return Discovery(tmp_path)
