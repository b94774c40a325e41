"""``horovod.ray`` on hora: ``RayExecutor`` and ``ElasticRayExecutor`` (see :mod:`hora.ray`)."""

from __future__ import annotations

from hora.ray import *  # noqa: F403
from hora.ray import __all__  # noqa: F401
