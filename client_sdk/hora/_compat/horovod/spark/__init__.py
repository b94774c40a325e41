"""``horovod.spark`` on hora: ``run`` and ``run_elastic`` (see :mod:`hora.spark`)."""

from __future__ import annotations

from hora.spark import *  # noqa: F403
from hora.spark import __all__  # noqa: F401
