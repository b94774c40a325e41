"""hora: distributed data-parallel training for PyTorch with Horovod's API.

The user surface is :mod:`hora.torch`; :func:`run` runs a Python function
on N workers (Horovod's ``horovod.run``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["run"]


def run(func: Any, *args: Any, **kwargs: Any) -> list[Any]:
    """Runs ``func`` on N workers; see :func:`hora.runner.run_func.run`."""
    # Imported when called: `import hora.torch` must stay light.
    from hora.runner.run_func import run as run_func

    return run_func(func, *args, **kwargs)
