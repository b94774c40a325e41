"""hora's stand-in for Horovod: ``import horovod.torch as hvd`` runs on hora.

Put on ``PYTHONPATH`` by ``horovodrun`` / ``horarun --horovod-compat`` only.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.28.1+hora"


def run(func: Any, *args: Any, **kwargs: Any) -> list[Any]:
    """Horovod's ``horovod.run``: runs ``func`` on N workers (see :func:`horovod.runner.run`)."""
    from horovod.runner import run as runner_run

    return runner_run(func, *args, **kwargs)
