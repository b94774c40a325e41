"""``horovod.keras`` on hora: every name of :mod:`hora.keras`."""

from hora.keras import *  # noqa: F403
from hora.keras import __all__  # noqa: F401
