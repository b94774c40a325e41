"""``horovod.torch.optimizer`` on hora: every public name of :mod:`hora.torch.optimizer`."""

from hora.torch.optimizer import *  # noqa: F403
from hora.torch.optimizer import __all__  # noqa: F401
