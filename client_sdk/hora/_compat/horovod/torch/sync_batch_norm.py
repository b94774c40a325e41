"""``horovod.torch.sync_batch_norm`` on hora: every public name of :mod:`hora.torch.sync_batch_norm`."""

from hora.torch.sync_batch_norm import *  # noqa: F403
from hora.torch.sync_batch_norm import __all__  # noqa: F401
