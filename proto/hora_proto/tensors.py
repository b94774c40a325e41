"""Sizes and fusion groups of tensors, by their wire description.

A request names its dtype as torch does without the prefix (``"float32"``).
The coordinator fuses responses and the trainers fuse cached rounds by the
same key, so both take it from here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["dtype_itemsize", "fusion_key", "tensor_nbytes"]

_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "float16": 2, "half": 2, "bfloat16": 2, "int16": 2, "uint16": 2, "short": 2,
    "float32": 4, "float": 4, "int32": 4, "uint32": 4, "int": 4, "complex32": 4,
    "float64": 8, "double": 8, "int64": 8, "uint64": 8, "long": 8, "complex64": 8,
    "complex128": 16,
}


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype name; unknown names count as 8 (never under-fuse)."""
    return _ITEMSIZE.get(dtype.removeprefix("torch."), 8)


def tensor_nbytes(dtype: str, shape: Iterable[int]) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape``."""
    return math.prod(shape) * dtype_itemsize(dtype)


def fusion_key(dtype: str, device: str, reduce_op: int, prescale_factor: float,
               postscale_factor: float, process_set_id: int = 0) -> tuple[object, ...]:
    """Allreduces with equal keys may share one fusion buffer."""
    return (dtype, device, reduce_op, prescale_factor, postscale_factor, process_set_id)
