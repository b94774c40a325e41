"""Gradient compression, framework-neutral: Horovod's ``hvd.Compression`` family.

The framework layers supply how to read a tensor's dtype and how to cast it
(:class:`CastCompressor`'s two hooks); which dtype goes on the wire, and
when, is decided here once.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CastCompressor", "Compressor", "NoneCompressor", "compression_family"]


class Compressor:
    """Turns a tensor into what goes over the wire, and back."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class CastCompressor(Compressor):
    """Sends floating-point tensors as ``wire_dtype`` and casts them back on arrival."""

    wire_dtype: Any = None

    @staticmethod
    def is_floating(tensor: Any) -> bool:
        raise NotImplementedError

    @staticmethod
    def cast(tensor: Any, dtype: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        if cls.is_floating(tensor) and tensor.dtype != cls.wire_dtype:
            return cls.cast(tensor, cls.wire_dtype), tensor.dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor: Any, ctx: Any) -> Any:
        return tensor if ctx is None else cls.cast(tensor, ctx)


def compression_family(base: type[CastCompressor], fp16: Any, bf16: Any) -> dict[str, type]:
    """The classes a framework exports: its FP16 and BF16 compressors and ``Compression``."""
    fp16_cls = type("FP16Compressor", (base,), {
        "wire_dtype": fp16, "__module__": base.__module__,
        "__doc__": "Sends floating-point tensors as float16, halving the bytes."})
    bf16_cls = type("BF16Compressor", (base,), {
        "wire_dtype": bf16, "__module__": base.__module__,
        "__doc__": "Sends floating-point tensors as bfloat16 (float32's range, less precision)."})
    compression = type("Compression", (), {
        "none": NoneCompressor, "fp16": fp16_cls, "bf16": bf16_cls,
        "__module__": base.__module__,
        "__doc__": "The compression algorithms, as ``hvd.Compression.none`` / ``.fp16`` / "
                   "``.bf16``."})
    return {"FP16Compressor": fp16_cls, "BF16Compressor": bf16_cls, "Compression": compression}
