"""``horovod.common.process_sets`` on hora: the process set API, and the registry
Horovod's frameworks read (``_get_process_set_ids_and_ranks``)."""

from __future__ import annotations

from hora import _runtime
from hora.torch.mpi_ops import ProcessSet, add_process_set, global_process_set, remove_process_set

__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]


def _get_process_set_ids_and_ranks() -> dict[int, list[int]]:
    """Every process set registered in this world, by id, with its global ranks;
    id 0 is the global set. The same on every rank (sets are added collectively).

    Raises:
        NotInitializedError: ``hvd.init()`` has not been called.
    """
    runtime = _runtime.current()
    sets = {0: list(range(runtime.world.size))}
    registered = runtime.engine._sets.registered()  # noqa: SLF001 - the engine's own table
    sets.update((set_id, list(ranks)) for set_id, ranks in sorted(registered.items()))
    return sets
