"""Worker functions for tests/e2e/test_torch_peer_loss.py (run by tests/support/worker_main.py).

:func:`poll_when_peer_dies`: an asynchronous allreduce whose peer is SIGKILLed while
this rank's engine is inside the data-plane call for it, waited on with
``hvd.poll`` alone (no ``synchronize``, whose wait polls the engine's failure).
The engine has taken the tensor out of its pending table by then, so the
generation's failure must still complete the handle it holds.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_plane_faults import die_in_the_data_plane  # noqa: E402

# How long the survivor's handle may stay incomplete once its peer is gone: the
# peer's death reaches the survivor in well under a second; the rest is slack.
DEADLINE_S = 60.0


def poll_when_peer_dies(victim: int, cached: bool) -> dict:
    import torch

    import hora.torch as hvd

    # 4 MiB: above what a cached round's control exchange carries, so the cached
    # tensor too is reduced on the data plane after the round.
    x = torch.ones(1 << 20) * (hvd.rank() + 1)
    warm = hvd.allreduce(x, name="victim" if cached else "warm", op=hvd.Sum)[:4].tolist()
    if hvd.rank() == victim:
        die_in_the_data_plane("victim", delay=1.0)
    handle = hvd.allreduce_async(x, name="victim", op=hvd.Sum)
    started = time.monotonic()
    while not hvd.poll(handle):
        if time.monotonic() - started > DEADLINE_S:
            return {"warm": warm, "how": "hung"}
        time.sleep(0.05)
    report: dict = {"warm": warm, "how": "completed", "seconds": time.monotonic() - started}
    try:
        report["value"] = hvd.synchronize(handle)[:4].tolist()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["error"] = [c.__name__ for c in type(exc).__mro__]
    return report
