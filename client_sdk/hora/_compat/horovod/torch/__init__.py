"""``horovod.torch`` on hora: every name of :mod:`hora.torch`."""

from hora.torch import *  # noqa: F403
from hora.torch import __all__  # noqa: F401
