"""``horovod.torch.elastic.sampler`` on hora: every public name of :mod:`hora.torch.elastic.sampler`."""

from hora.torch.elastic.sampler import *  # noqa: F403
from hora.torch.elastic.sampler import __all__  # noqa: F401
