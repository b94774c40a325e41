"""``horovod.tensorflow.keras.elastic`` on hora: every name of :mod:`hora.tensorflow.keras.elastic`."""

from hora.tensorflow.keras.elastic import *  # noqa: F403
from hora.tensorflow.keras.elastic import __all__  # noqa: F401
