"""Gradient compression for allreduce: Horovod's ``hvd.Compression`` (see :mod:`hora._compression`)."""

from __future__ import annotations

from typing import Any

import torch

from .._compression import CastCompressor, Compressor, NoneCompressor, compression_family

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class _TorchCast(CastCompressor):
    @staticmethod
    def is_floating(tensor: Any) -> bool:
        return bool(tensor.dtype.is_floating_point)

    @staticmethod
    def cast(tensor: Any, dtype: Any) -> Any:
        return tensor.to(dtype)


_family = compression_family(_TorchCast, torch.float16, torch.bfloat16)
FP16Compressor: type[CastCompressor] = _family["FP16Compressor"]
BF16Compressor: type[CastCompressor] = _family["BF16Compressor"]
Compression: Any = _family["Compression"]
