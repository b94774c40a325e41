"""``horovod.torch.functions`` on hora: every public name of :mod:`hora.torch.functions`."""

from hora.torch.functions import *  # noqa: F403
from hora.torch.functions import __all__  # noqa: F401
