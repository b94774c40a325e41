"""``horovod.runner`` on hora: :func:`run` runs a function on N workers."""

from __future__ import annotations

from typing import Any

__all__ = ["run"]


def run(func: Any, *args: Any, **kwargs: Any) -> list[Any]:
    """Horovod's ``horovod.runner.run``: see :func:`hora.runner.run_func.run`.

    The workers get the ``horovod`` shim too, so the function may
    ``import horovod.torch``.
    """
    from hora.runner.run_func import run as run_func

    kwargs.setdefault("horovod_compat", True)
    return run_func(func, *args, **kwargs)
