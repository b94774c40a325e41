"""``horovod.runner.common.util.env`` on hora: what a worker learns from its environment."""

from __future__ import annotations

import os

__all__ = ["get_env_rank_and_size"]

# The launchers' variables, in Horovod's order of preference; hora's own first.
_RANK_AND_SIZE = (("HORA_RANK", "HORA_SIZE"), ("HOROVOD_RANK", "HOROVOD_SIZE"),
                  ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"))


def get_env_rank_and_size() -> tuple[int, int]:
    """This process's ``(rank, size)`` as its launcher set them: ``(0, 1)`` when no
    launcher did.

    Raises:
        RuntimeError: only one of a pair is set (a rank without a size, or the reverse).
    """
    for rank_var, size_var in _RANK_AND_SIZE:
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError(f"Could not determine process rank and size: only one of "
                               f"{rank_var} and {size_var} found in environment")
    return 0, 1
