"""``horovod.common.util`` on hora: what scripts and tests use from Horovod's helpers.

The ``*_built`` answers are hora's own (hora.torch.mpi_ops), so they are
true of this installation: Gloo always, NCCL when torch has it, never MPI,
oneCCL or DDL.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = [
    "ccl_built", "check_extension", "cuda_built", "ddl_built", "env", "extension_available",
    "get_average_backwards_compatibility_fun", "gloo_built", "gpu_available", "is_iterable",
    "is_version_greater_equal_than", "mpi_built", "nccl_built", "num_rank_is_power_2",
    "rocm_built", "split_list",
]


def _ops() -> Any:
    # Imported when asked: torch is heavy and only these answers need it.
    from hora.torch import mpi_ops

    return mpi_ops


def gloo_built(verbose: bool = False) -> bool:
    """Whether collectives can run over Gloo (always, on hora)."""
    return bool(_ops().gloo_built())


def nccl_built(verbose: bool = False) -> int:
    """NCCL's version code when torch was built with it, else 0 (Horovod's convention)."""
    return int(_ops().nccl_built())


def mpi_built(verbose: bool = False) -> bool:
    """False: hora never uses MPI."""
    return bool(_ops().mpi_built())


def ccl_built(verbose: bool = False) -> bool:
    """False: hora does not use oneCCL."""
    return bool(_ops().ccl_built())


def ddl_built(verbose: bool = False) -> bool:
    """False: hora does not use IBM DDL."""
    return bool(_ops().ddl_built())


def cuda_built(verbose: bool = False) -> bool:
    """Whether CUDA tensors can be reduced (torch with CUDA and NCCL)."""
    return bool(_ops().cuda_built())


def rocm_built(verbose: bool = False) -> bool:
    """Whether ROCm tensors can be reduced."""
    return bool(_ops().rocm_built())


def extension_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether Horovod's extension for a framework is usable: ``torch``, and ``tensorflow``
    and ``keras`` where TensorFlow is installed (hora.tensorflow runs on torch's engine)."""
    if importlib.util.find_spec("torch") is None:
        return False
    if ext_base_name == "torch":
        return True
    return ext_base_name in ("tensorflow", "keras") and \
        importlib.util.find_spec("tensorflow") is not None


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether the framework's tensors can be reduced on a GPU (``torch`` only, on hora:
    hora.tensorflow hands its tensors to the engine through host memory)."""
    if ext_base_name != "torch" or not extension_available(ext_base_name):
        return False
    import torch

    return bool(torch.cuda.is_available())


def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args: Any) -> None:
    """Raises ImportError unless ``ext_name`` is one hora provides (``horovod.torch``)."""
    if ext_name not in ("horovod.torch", "torch"):
        raise ImportError(f"Extension {ext_name} has not been built: hora provides "
                          f"horovod.torch only (nothing is built, so {ext_env_var} has no "
                          f"effect)")


def split_list(items: Sequence[Any], n: int) -> list[Sequence[Any]]:
    """``items`` cut into ``n`` consecutive parts whose lengths differ by at most one."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    size, extra = divmod(len(items), n)
    parts, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        parts.append(items[start:end])
        start = end
    return parts


def is_iterable(x: Any) -> bool:
    """Whether ``iter(x)`` works."""
    try:
        iter(x)
    except TypeError:
        return False
    return True


def num_rank_is_power_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a power of two (what Adasum needs)."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def get_average_backwards_compatibility_fun(reduce_ops: Any) -> Callable[..., Any]:
    """Horovod's resolver of the old ``average=`` argument against ``op=``.

    Args:
        reduce_ops: an object with ``Average`` and ``Sum`` (``horovod.torch``).

    Returns:
        ``impl(op, average)`` giving the op to use: ``op`` when given,
        ``Average``/``Sum`` from ``average``, ``Average`` by default.

    Raises:
        ValueError: both ``op`` and ``average`` were given.
    """
    def impl(op: Any, average: bool | None) -> Any:
        if op is not None:
            if average is not None:
                raise ValueError("The op parameter supersedes average. Please provide only one "
                                 "of them.")
            return op
        if average is not None:
            return reduce_ops.Average if average else reduce_ops.Sum
        return reduce_ops.Average

    return impl


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """Whether version ``ver`` is at least ``target`` (``major.minor.patch``)."""
    def parts(text: str) -> tuple[int, ...]:
        numbers = []
        for piece in text.split("+")[0].split(".")[:3]:
            digits = "".join(ch for ch in piece if ch.isdigit())
            numbers.append(int(digits or 0))
        return tuple(numbers)

    return parts(ver) >= parts(target)


@contextlib.contextmanager
def env(**kwargs: Any) -> Iterator[None]:
    """Sets environment variables for the ``with`` block, then restores them.

    A value of None unsets the variable for the block.
    """
    saved = {name: os.environ.get(name) for name in kwargs}
    try:
        for name, value in kwargs.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = str(value)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
