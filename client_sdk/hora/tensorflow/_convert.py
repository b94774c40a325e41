"""The edge between TensorFlow and the engine: TF values in, torch tensors out, and back.

The engine moves torch tensors (its buffers, fusion and data plane are
torch's); a TF tensor on the CPU becomes a numpy array and then a torch
tensor over the same memory, and a result goes back the same way. Nothing
else happens here: what a collective does is decided in :mod:`hora.torch`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["to_numpy", "to_torch"]

try:  # TensorFlow's bfloat16 is ml_dtypes' (a TensorFlow dependency)
    from ml_dtypes import bfloat16 as _np_bfloat16
except ImportError:  # pragma: no cover - ml_dtypes comes with TensorFlow
    _np_bfloat16 = None


def to_torch(value: Any, copy: bool = False) -> torch.Tensor:
    """A torch tensor over ``value``'s bytes.

    Args:
        value: a numpy array (or anything ``np.asarray`` takes: an eager TF tensor).
        copy: give the tensor its own memory, for collectives that write in place
            (an eager tensor's ``numpy()`` may share the tensor's buffer). Read-only
            or strided arrays are copied anyway.
    """
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    if copy or not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array, order="C", copy=True)
    if _np_bfloat16 is not None and array.dtype == _np_bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` as a numpy array over the same memory (bfloat16 as ml_dtypes')."""
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy().view(_np_bfloat16)
    return tensor.numpy()
