"""``horovod.torch.mpi_ops`` on hora: every public name of :mod:`hora.torch.mpi_ops`."""

from horovod.common.process_sets import _get_process_set_ids_and_ranks  # noqa: F401

from hora.torch.mpi_ops import *  # noqa: F403
from hora.torch.mpi_ops import __all__  # noqa: F401
