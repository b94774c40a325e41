"""The torch semantics sweep on CUDA tensors: every collective's inputs on the GPU.

Runs the dtype matrix and the empty-tensor section of ``horovod_semantics.py``
with every tensor argument moved to this rank's GPU before the call, and
checks that every result comes back on that GPU before comparing it (on the
host) with the same references as the CPU sweep. In-place calls
(``allreduce_``, ``broadcast_``, ``allreduce_async_`` then ``synchronize``)
are checked through the GPU tensor the call changed.

    horarun -np N python tests/e2e/horovod_cuda.py

needs a CUDA device for each local rank (``hora.torch.local_rank()`` picks it).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import horovod_semantics  # noqa: E402 - the sibling sweep

_real = horovod_semantics.hvd
_IN_PLACE = {"allreduce_", "broadcast_", "allreduce_async_"}
_COLLECTIVES = {"allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
                "grouped_allreduce", "grouped_allgather", "grouped_reducescatter",
                "allreduce_async", "sparse_allreduce_async"} | _IN_PLACE


class OffDevice(RuntimeError):
    """A collective on GPU tensors returned a tensor that is not on the GPU."""


def _to_gpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cuda()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_gpu(v) for v in value)
    return value


def _to_host(value: Any, what: str) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cuda":
            raise OffDevice(f"{what} returned a tensor on {value.device}")
        return value.cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v, what) for v in value)
    return value


class CudaHvd:
    """``hora.torch`` with every collective's tensors on the GPU, results back on the host."""

    def __init__(self) -> None:
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.gpu_calls = 0

    def __getattr__(self, name: str) -> Any:
        real = getattr(_real, name)
        if name not in _COLLECTIVES:
            return real

        def call(*args: Any, **kwargs: Any) -> Any:
            self.gpu_calls += 1
            gpu_args = [_to_gpu(a) for a in args]
            result = real(*gpu_args, **{k: _to_gpu(v) for k, v in kwargs.items()})
            if name in _IN_PLACE:
                host, gpu = args[0], gpu_args[0]
                if name == "allreduce_async_":
                    self._pending[id(result)] = (host, gpu)
                    return result
                host.copy_(_to_host(gpu, name))
                return host
            if name.endswith("_async"):
                return result
            if name == "alltoall" and isinstance(result, tuple):
                # Horovod gives the received splits as a host tensor, like the splits
                out, received = result
                return _to_host(out, name), received
            return _to_host(result, name)

        return call

    def synchronize(self, handle: Any) -> Any:
        result = _real.synchronize(handle)
        if id(handle) in self._pending:
            host, gpu = self._pending.pop(id(handle))
            host.copy_(_to_host(gpu, "allreduce_async_"))
            return host
        return _to_host(result, "synchronize")


def main() -> int:
    _real.init()
    torch.cuda.set_device(_real.local_rank() % torch.cuda.device_count())
    proxy = CudaHvd()
    horovod_semantics.hvd = proxy
    sys.modules.setdefault("horovod_semantics", horovod_semantics)
    import horovod_empty

    horovod_empty.hvd = proxy
    rank = _real.rank()
    if _real.size() == 1:  # a set of rank 0 alone would repeat the global set
        horovod_semantics._SETS.append(("global", _real.global_process_set, [0]))
    problems = []
    matrix = horovod_semantics.dtype_matrix()
    empty = horovod_empty.empty_tensors()
    for section, report in (("dtype matrix", matrix), ("empty tensors", empty)):
        if report["failed"]:
            problems.append(f"{section}: {report['failed']} failed, e.g. {report['failures'][:5]}")
    print(f"rank {rank} on {torch.cuda.get_device_name()}: {proxy.gpu_calls} collectives on "
          f"CUDA tensors; dtype matrix {matrix['checks']} checks, {matrix['failed']} failed; "
          f"empty tensors {empty['checks']} checks, {empty['failed']} failed", flush=True)
    for problem in problems:
        print(f"rank {rank}: {problem}", file=sys.stderr, flush=True)
    _real.shutdown()
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
