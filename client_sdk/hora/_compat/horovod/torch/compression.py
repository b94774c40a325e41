"""``horovod.torch.compression`` on hora: every public name of :mod:`hora.torch.compression`."""

from hora.torch.compression import *  # noqa: F403
from hora.torch.compression import __all__  # noqa: F401
