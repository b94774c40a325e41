"""``hora.keras.callbacks``: the same as ``hora.tensorflow.keras.callbacks``."""

from hora.tensorflow.keras.callbacks import *  # noqa: F403
from hora.tensorflow.keras.callbacks import __all__  # noqa: F401
