"""Where the ``horovod`` import shim lives (see :func:`shim_path`).

The folder ``horovod/`` beside this file is a tiny package that re-exports
hora under Horovod's import names. It is never on ``sys.path`` by default,
so it cannot shadow a real Horovod: ``horovodrun`` (or ``horarun
--horovod-compat``) puts it on the workers' ``PYTHONPATH`` after checking
that no real Horovod is importable.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["real_horovod_location", "shim_path"]


def shim_path() -> str:
    """The directory to put on ``PYTHONPATH`` so that ``import horovod.torch`` gives hora."""
    return str(Path(__file__).resolve().parent)


def real_horovod_location() -> str | None:
    """Where a real (non-shim) Horovod is installed for this interpreter, if anywhere."""
    spec = importlib.util.find_spec("horovod")
    if spec is None or spec.origin is None:
        return None
    origin = str(Path(spec.origin).resolve())
    if origin.startswith(shim_path()):
        return None
    return origin
