"""``horovod.tensorflow`` on hora: every name of :mod:`hora.tensorflow`."""

from hora.tensorflow import *  # noqa: F403
from hora.tensorflow import __all__  # noqa: F401
