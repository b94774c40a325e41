"""``horovod.tensorflow.elastic`` on hora: every name of :mod:`hora.tensorflow.elastic`."""

from hora.tensorflow.elastic import *  # noqa: F403
from hora.tensorflow.elastic import __all__  # noqa: F401
