"""``horovod.runner.util.threads`` on hora: every name of :mod:`hora.runner.threads`."""

from hora.runner.threads import *  # noqa: F403
from hora.runner.threads import __all__  # noqa: F401
