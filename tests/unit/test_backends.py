"""Backend selection: CPU tensors go to Gloo, CUDA tensors to NCCL, lazily imported."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest
import torch

from hora_native import BackendError, available, backend_for_device, create_backend

pytestmark = pytest.mark.unit


def test_devices_map_to_backends():
    assert backend_for_device("cpu") == "gloo"
    assert backend_for_device("cuda") == "nccl"
    assert backend_for_device("xpu") == "xccl"
    with pytest.raises(BackendError, match="'mps'"):
        backend_for_device("mps")


def test_gloo_is_available_and_nccl_only_with_a_gpu():
    assert available("gloo")
    assert available("nccl") == (torch.cuda.is_available()
                                 and torch.distributed.is_nccl_available())


def test_xccl_is_available_and_ccl_built_only_with_torch_for_xpu():
    from hora.torch import ccl_built

    built = bool(getattr(torch.distributed, "is_xccl_available", lambda: False)()
                 and hasattr(torch.distributed, "ProcessGroupXCCL"))
    assert ccl_built() == built
    assert available("xccl") == (built and torch.xpu.is_available())


@pytest.mark.skipif(torch.xpu.is_available(), reason="checks the error without an XPU")
def test_xccl_without_an_xpu_is_a_clear_error():
    with pytest.raises(BackendError, match="'xccl' is not available"):
        create_backend("xccl", torch.distributed.HashStore(), 0, 1, timedelta(seconds=5),
                       "127.0.0.1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on CPU-only machines")
def test_nccl_without_a_gpu_is_a_clear_error():
    store = torch.distributed.HashStore()
    with pytest.raises(BackendError, match="'nccl' is not available"):
        create_backend("nccl", store, 0, 1, timedelta(seconds=5), "127.0.0.1")


def test_unknown_backend_names_the_known_ones():
    with pytest.raises(BackendError, match="known: \\['gloo', 'nccl', 'xccl'\\]"):
        create_backend("mpi", torch.distributed.HashStore(), 0, 1, timedelta(seconds=1), "")


def test_importing_hora_torch_imports_no_accelerator_backend_and_prints_nothing():
    code = ("import sys, hora.torch; "
            "print(sorted(m for m in sys.modules if m.startswith('hora_native.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "['hora_native.base', 'hora_native.registry']"
    assert out.stderr == ""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_single_rank_nccl_allreduce():
    from hora_native import ReduceKind

    backend = create_backend("nccl", torch.distributed.HashStore(), 0, 1,
                             timedelta(seconds=30), "127.0.0.1")
    t = torch.ones(4, device="cuda")
    backend.allreduce(t, ReduceKind.SUM)
    assert t.tolist() == [1.0] * 4
    backend.close()


def test_single_rank_gloo_collectives():
    from hora_native import ReduceKind

    backend = create_backend("gloo", torch.distributed.HashStore(), 0, 1,
                             timedelta(seconds=30), "127.0.0.1")
    t = torch.arange(4.0)
    backend.allreduce(t, ReduceKind.MAX)
    out = torch.empty(4)
    backend.allgatherv(out, t, [4])
    backend.broadcast(t, 0)
    backend.barrier()
    assert out.tolist() == t.tolist() == [0.0, 1.0, 2.0, 3.0]
    backend.close()


def test_ranks_that_share_a_gpu_are_found_by_every_rank():
    import threading

    from hora_native.staged import shared_devices

    store = torch.distributed.HashStore()
    devices = ["gpu-a", "gpu-b", "gpu-a", "gpu-c", "gpu-b"]
    found: dict[int, dict[str, list[int]]] = {}

    def run(rank: int) -> None:
        found[rank] = shared_devices(store, rank, len(devices), identity=devices[rank])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(devices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert found == {r: {"gpu-a": [0, 2], "gpu-b": [1, 4]} for r in range(len(devices))}
    alone = torch.distributed.HashStore()
    assert shared_devices(alone, 0, 1, identity="gpu-a") == {}


def test_host_staged_backend_runs_every_collective_through_its_inner_backend():
    from hora_native import ReduceKind
    from hora_native.staged import HostStagedBackend

    inner = create_backend("gloo", torch.distributed.HashStore(), 0, 1,
                           timedelta(seconds=30), "127.0.0.1")
    staged = HostStagedBackend(inner)
    t = torch.arange(4.0)
    staged.allreduce(t, ReduceKind.MAX)
    out = torch.zeros(4)
    staged.allgatherv(out, t, [4])
    moved = torch.zeros(4)
    staged.alltoallv(moved, t, [4], [4])
    scattered = torch.zeros(4)
    staged.reducescatter(scattered, t, ReduceKind.SUM, [4])
    staged.broadcast(t, 0)
    staged.barrier()
    assert out.tolist() == moved.tolist() == scattered.tolist() == t.tolist() == [0.0, 1.0, 2.0,
                                                                                  3.0]
    staged.close()
    with pytest.raises(BackendError, match="closed"):
        staged.allreduce(t, ReduceKind.SUM)
