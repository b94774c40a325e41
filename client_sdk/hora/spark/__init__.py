"""hora on Spark: Horovod's ``horovod.spark`` API (``run``, ``run_elastic``).

Imports PySpark when a job runs; ``import hora`` never imports this package.
Install with ``pip install hora[spark]``. Horovod's Spark estimators
(``KerasEstimator``, ``TorchEstimator``, ``LightningEstimator``) are not
here yet. See docs/ray_spark.md.
"""

from __future__ import annotations

from .runner import SparkRunError, run, run_elastic

__all__ = ["SparkRunError", "run", "run_elastic"]
