"""``horovod.keras.callbacks`` on hora: every name of :mod:`hora.keras.callbacks`."""

from hora.keras.callbacks import *  # noqa: F403
from hora.keras.callbacks import __all__  # noqa: F401
