"""``horovod.tensorflow.compression`` on hora: every name of :mod:`hora.tensorflow.compression`."""

from hora.tensorflow.compression import *  # noqa: F403
from hora.tensorflow.compression import __all__  # noqa: F401
