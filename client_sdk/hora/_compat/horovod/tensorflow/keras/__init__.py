"""``horovod.tensorflow.keras`` on hora: every name of :mod:`hora.tensorflow.keras`."""

from hora.tensorflow.keras import *  # noqa: F403
from hora.tensorflow.keras import __all__  # noqa: F401
