"""``horovod.torch.elastic.state`` on hora: every public name of :mod:`hora.torch.elastic.state`."""

from hora.torch.elastic.state import *  # noqa: F403
from hora.torch.elastic.state import __all__  # noqa: F401
