"""What hora.ray and hora.spark share: the job identity, the horovod shim, pickling.

Nothing here imports Ray or PySpark.
"""

from __future__ import annotations

import os
import secrets
import sys
import uuid
from typing import Any

import cloudpickle

__all__ = ["active_shim", "dumps", "enter_shim", "job_identity", "loads"]


def job_identity(token: str | None) -> tuple[str, str]:
    """A fresh job id and the job token (``token``, or a random one)."""
    return f"job-{uuid.uuid4().hex[:12]}", token or secrets.token_hex(16)


def active_shim() -> str | None:
    """The ``horovod`` shim's folder when this process imports it (``python -m hora.horovod``,
    ``horovodrun``), so that the workers this process starts see it too; else None."""
    from hora._compat import shim_path

    shim = shim_path()
    module = sys.modules.get("horovod")
    origin = getattr(module, "__file__", None) or ""
    if module is not None and os.path.realpath(origin).startswith(shim):
        return shim
    if shim in sys.path or shim in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        return shim
    return None


def enter_shim(shim: str | None) -> None:
    """Puts the shim first on this worker's path (and its children's), when the driver had it.

    Raises:
        RuntimeError: a real Horovod is installed where the worker runs; it
            is never shadowed silently.
    """
    if shim is None:
        return
    from hora._compat import real_horovod_location, shim_path

    local = shim_path()
    real = real_horovod_location()
    if real is not None:
        raise RuntimeError(f"a real Horovod is installed on this node ({real}); hora will not "
                           f"shadow it with its horovod shim")
    if local not in sys.path:
        sys.path.insert(0, local)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if local not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([local, *paths])


def dumps(value: object) -> bytes:
    """Pickles a user function and its arguments (cloudpickle: closures and lambdas work)."""
    return cloudpickle.dumps(value)


def loads(data: bytes) -> Any:
    """Unpickles what :func:`dumps` made, after :func:`enter_shim` (it may import horovod)."""
    return cloudpickle.loads(data)
