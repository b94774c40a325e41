"""hora.keras: Horovod's ``horovod.keras`` (Keras on TensorFlow); the same as
:mod:`hora.tensorflow.keras`."""

from hora.tensorflow.keras import *  # noqa: F403
from hora.tensorflow.keras import __all__, callbacks, elastic  # noqa: F401
