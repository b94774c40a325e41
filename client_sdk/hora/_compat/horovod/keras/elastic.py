"""``horovod.keras.elastic`` on hora: every name of :mod:`hora.keras.elastic`."""

from hora.keras.elastic import *  # noqa: F403
from hora.keras.elastic import __all__  # noqa: F401
