"""The fused buffer's check of a step's gradients (hora/torch/_fused.py): a
gradient or parameter that no longer has the dtype, shape or device the
buffer was sized for makes the step invalid, with a message naming it,
instead of a copy that torch refuses halfway through the step (a model moved
to another GPU after training began)."""

from __future__ import annotations

import torch

from hora.torch._fused import _changed

CPU = torch.device("cpu")


def test_a_tensor_that_still_fits_is_no_problem():
    assert _changed("w", "gradient", torch.zeros(2, 3), torch.float32, torch.Size([2, 3]),
                    CPU) is None


def test_each_change_is_named():
    shape = torch.Size([2, 3])
    cases = {
        "dtype": torch.zeros(2, 3, dtype=torch.float64),
        "shape": torch.zeros(6),
        "device": torch.zeros(2, 3, device="meta"),
    }
    for what, tensor in cases.items():
        problem = _changed("w", "parameter", tensor, torch.float32, shape, CPU)
        assert problem is not None and "the parameter of 'w'" in problem, (what, problem)
    assert "meta" in _changed("w", "gradient", cases["device"], torch.float32, shape, CPU)
