"""``horovod.tensorflow`` on hora: every name of :mod:`hora.tensorflow`, and the
semi-private helpers of Horovod's that scripts and tools import."""

from __future__ import annotations

from typing import Any

import tensorflow as _tf
from horovod.common.process_sets import _get_process_set_ids_and_ranks  # noqa: F401
from horovod.common.util import check_extension, gpu_available, split_list  # noqa: F401
from horovod.common.util import get_average_backwards_compatibility_fun as _average_fun
from horovod.common.util import num_rank_is_power_2 as check_num_rank_power_of_2  # noqa: F401
from horovod.tensorflow.util import (  # noqa: F401
    _cache,
    _executing_eagerly,
    _make_subgraph,
    refs_to_vars,
    vars_to_refs,
)

from hora.tensorflow import *  # noqa: F403
from hora.tensorflow import __all__ as _hora_all
from hora.tensorflow import mpi_ops as _mpi_ops
from hora.tensorflow.functions import broadcast_variables

handle_average_backwards_compatibility = _average_fun(_mpi_ops)

__all__ = [*_hora_all, "BroadcastGlobalVariablesHook", "check_num_rank_power_of_2",
           "gpu_available", "handle_average_backwards_compatibility", "refs_to_vars",
           "split_list", "vars_to_refs"]


class BroadcastGlobalVariablesHook(_tf.compat.v1.train.SessionRunHook):
    """TF1's ``SessionRunHook`` that broadcasts the global variables from ``root_rank`` once
    the session is made (``tf.compat.v1.train.MonitoredTrainingSession`` and Estimators)."""

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op: Any = None

    def begin(self) -> None:
        graph = _tf.compat.v1.get_default_graph()
        if self.bcast_op is None or self.bcast_op.graph != graph:
            with _tf.device(self.device):
                # In a TF1 graph this is the group of broadcast-and-assign ops to run.
                self.bcast_op = broadcast_variables(_tf.compat.v1.global_variables(),
                                                    self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)
