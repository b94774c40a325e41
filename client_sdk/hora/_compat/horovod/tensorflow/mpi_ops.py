"""``horovod.tensorflow.mpi_ops`` on hora: every name of :mod:`hora.tensorflow.mpi_ops`."""

from hora.tensorflow.mpi_ops import *  # noqa: F403
from hora.tensorflow.mpi_ops import __all__  # noqa: F401
