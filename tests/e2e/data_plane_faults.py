"""A fault for worker scenarios: a rank that dies inside the data-plane call of a tensor.

Imported by scenario files that put their own folder on ``sys.path``
(tests/e2e/tf_graph_peer_loss_worker.py, tests/e2e/torch_peer_loss_worker.py).
"""

from __future__ import annotations

import os
import signal
import time


def die_in_the_data_plane(name: str, delay: float) -> None:
    """This rank SIGKILLs itself ``delay`` s after its engine starts reducing ``name``:
    by then its peers are blocked in the same data-plane call."""
    from hora.engine import executor

    allreduce = executor.Executor.allreduce

    def dying(self, backend, entries, *args, **kwargs):  # type: ignore[no-untyped-def]
        if any(entry.name == name for entry in entries):
            time.sleep(delay)
            os.kill(os.getpid(), signal.SIGKILL)
        return allreduce(self, backend, entries, *args, **kwargs)

    executor.Executor.allreduce = dying  # type: ignore[method-assign]
