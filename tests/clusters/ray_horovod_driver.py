"""A Horovod driver script, as users wrote it for horovod.ray; run with
``python -m hora.horovod ray_horovod_driver.py ADDRESS``.

Checks, on the test's two-node cluster, what the Ray suite wants of one run:
the shim reaches the actors, ranks and placement, a rank that raises, an
actor that dies, and a cluster too small. Prints ``RESULT {json}``.
"""

import json
import os
import sys
import time
import urllib.request

import ray
from horovod.ray import RayExecutor

TOKEN = "ray-driver-test-token"


def collective(offset):
    import horovod.torch as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + offset)]), op=hvd.Sum).item()
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "cross_rank": hvd.cross_rank(), "sum": total, "module": hvd.__name__,
            "host": os.environ["HOROVOD_HOSTNAME"], "pid": os.getpid()}


def raises_on_rank_1():
    import horovod.torch as hvd

    if hvd.rank() == 1:
        raise ValueError("rank 1 gives up")
    return hvd.rank()


def dies_on_rank_1():
    import horovod.torch as hvd

    if hvd.rank() == 1:
        os._exit(3)
    hvd.allreduce(__import__("torch").ones(1), name="after.death")
    return hvd.rank()


def main():
    ray.init(address=sys.argv[1])
    out = {}
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60, token=TOKEN), num_hosts=2,
                           num_workers_per_host=1, cpus_per_worker=1)
    began = time.monotonic()
    executor.start()
    out["start_s"] = time.monotonic() - began
    out["run"] = executor.run(collective, args=[10])
    # The dashboard's rank map: Ray node IP as host, the actor's pid.
    url = (f"{executor.dashboard}/api/v1/jobs/{executor.job_id}/ranks?token={TOKEN}")
    with urllib.request.urlopen(url, timeout=30) as answer:
        out["dashboard"] = [{"rank": r["rank"], "host": r["host"], "pid": r["pid"]}
                            for r in json.load(answer)]
    out["execute_single"] = executor.execute_single(lambda _: "chief")
    out["run_remote"] = ray.get(executor.run_remote(lambda: "remote"))
    try:
        executor.run(raises_on_rank_1)
    except Exception as exc:
        out["raised"] = {"type": type(exc).__name__, "message": str(exc),
                         "rank": getattr(exc, "rank", None)}
    try:
        executor.run(dies_on_rank_1)
    except Exception as exc:
        out["died"] = {"type": type(exc).__name__, "message": str(exc),
                       "rank": getattr(exc, "rank", None)}
    executor.shutdown()

    too_big = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=3,
                          cpus_per_worker=1)
    began = time.monotonic()
    try:
        too_big.start()
    except Exception as exc:
        out["too_big"] = {"type": type(exc).__name__, "message": str(exc),
                          "seconds": time.monotonic() - began}
    spread = RayExecutor(RayExecutor.create_settings(timeout_s=8, placement_group_timeout_s=8),
                         num_hosts=1, num_workers_per_host=1, cpus_per_worker=1.5)
    began = time.monotonic()
    try:
        spread.start()
    except Exception as exc:
        out["unplaceable"] = {"type": type(exc).__name__, "message": str(exc),
                              "seconds": time.monotonic() - began}
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
