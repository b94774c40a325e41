"""``horovod.tensorflow.functions`` on hora: every name of :mod:`hora.tensorflow.functions`."""

from hora.tensorflow.functions import *  # noqa: F403
from hora.tensorflow.functions import __all__  # noqa: F401
