"""``horovod.tensorflow.keras.callbacks`` on hora: every name of :mod:`hora.tensorflow.keras.callbacks`."""

from hora.tensorflow.keras.callbacks import *  # noqa: F403
from hora.tensorflow.keras.callbacks import __all__  # noqa: F401
