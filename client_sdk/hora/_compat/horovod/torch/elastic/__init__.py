"""``horovod.torch.elastic`` on hora."""

from hora.torch.elastic import *  # noqa: F403
from hora.torch.elastic import __all__  # noqa: F401
