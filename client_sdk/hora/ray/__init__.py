"""hora on Ray: Horovod's ``horovod.ray`` API (``RayExecutor``, ``ElasticRayExecutor``).

Imports Ray; ``import hora`` never imports this package. Install with
``pip install hora[ray]``. See docs/ray_spark.md.
"""

from __future__ import annotations

from .elastic import ElasticRayExecutor, ElasticRaySettings
from .executor import RayExecutor, RayExecutorError, RaySettings

__all__ = ["ElasticRayExecutor", "ElasticRaySettings", "RayExecutor", "RayExecutorError",
           "RaySettings"]
