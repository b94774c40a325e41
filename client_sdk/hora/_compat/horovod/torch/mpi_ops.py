"""``horovod.torch.mpi_ops`` on hora: every public name of :mod:`hora.torch.mpi_ops`, and
Horovod's helpers from there that scripts import."""

from horovod.common.process_sets import _get_process_set_ids_and_ranks  # noqa: F401
from horovod.common.util import get_average_backwards_compatibility_fun as _average_fun
from horovod.common.util import num_rank_is_power_2 as check_num_rank_power_of_2  # noqa: F401

from hora.torch import mpi_ops as _mpi_ops
from hora.torch.mpi_ops import *  # noqa: F403
from hora.torch.mpi_ops import __all__  # noqa: F401

handle_average_backwards_compatibility = _average_fun(_mpi_ops)
