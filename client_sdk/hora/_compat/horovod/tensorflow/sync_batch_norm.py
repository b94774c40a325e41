"""``horovod.tensorflow.sync_batch_norm`` on hora."""

from hora.tensorflow.sync_batch_norm import *  # noqa: F403
from hora.tensorflow.sync_batch_norm import __all__  # noqa: F401
