"""``horovod.torch`` on hora: every name of :mod:`hora.torch`, and the semi-private
helpers of Horovod's that scripts and tools import."""

from horovod.common.process_sets import _get_process_set_ids_and_ranks  # noqa: F401
from horovod.common.util import check_extension, gpu_available, split_list  # noqa: F401

from hora.torch import *  # noqa: F403
from hora.torch import __all__  # noqa: F401
