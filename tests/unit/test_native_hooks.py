"""The optimizer's C++ helpers (hora/torch/hora_torch_hooks.cpp): built against the
installed torch, they note gradients as Python's hooks do and check the fused
buffer's views as Python's checks do, through a parameter's new data too."""

from __future__ import annotations

import gc
import shutil
import sysconfig
import weakref
from pathlib import Path

import pytest
import tomllib
import torch
import torch.nn as nn

from hora.torch import _native
from hora.torch._native import hooks_module
from hora.torch._notes import NativeNotes, PyNotes

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def native():
    module = hooks_module()
    if module is None:
        headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
        if (shutil.which("g++") or shutil.which("c++")) and headers.exists():
            pytest.fail(f"a C++ compiler and Python's headers are here but the hooks did not "
                        f"build: {_native._failed}")
        pytest.skip(f"the optimizer uses its Python hooks here: {_native._failed}")
    return module


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _backward(model: nn.Module) -> None:
    model(torch.randn(5, 4)).pow(2).sum().backward()


def _hooked(notes, params: list[torch.Tensor], skip: int) -> list:
    """Hooks like the optimizer's: every parameter but ``skip`` noted by ``notes``,
    ``skip`` by a Python hook that notes it too (the sentinel's)."""
    handles = notes.hook(params, skip)
    handles.append(params[skip].register_post_accumulate_grad_hook(notes.append))
    return handles


@pytest.mark.parametrize("kind", ["native", "python"])
def test_notes_come_in_backward_order_and_stop_when_removed(native, kind):
    model = _model()
    params = list(model.parameters())
    notes = NativeNotes(native, params) if kind == "native" else PyNotes()
    handles = _hooked(notes, params, skip=3)
    _backward(model)
    # Backward reaches the last layer first: its bias and weight, then the first's.
    assert {id(p) for p in notes} == {id(p) for p in params}
    assert len(notes) == 4 and notes[0] is params[3]
    assert notes.noted_twice() is None
    _backward(model)  # a second pass before the step
    assert notes.noted_twice() is notes[0] and len(notes) == 8
    assert notes.has(params[0])
    notes.dedupe()
    assert len(notes) == 4
    notes.clear()
    assert not notes and not notes.has(params[0])
    for handle in handles:
        handle.remove()
    _backward(model)
    assert len(notes) == 0


class _Scaled(nn.Module):
    """A layer whose output is scaled by a parameter that broadcasts: its shape
    may change (fused_misfit in tests/multiprocess/scenarios_fused.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.scale = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_a_parameter_given_new_data_is_hooked_again(native):
    torch.manual_seed(0)
    model = _Scaled()
    params = list(model.parameters())
    notes = NativeNotes(native, params)
    _hooked(notes, params, skip=0)
    _backward(model)
    assert len(notes) == 3
    notes.clear()
    # Another shape: torch keeps the accumulator (the hooks hold it), made for the
    # old shape; refreshed, the pass takes the new shape's gradient, and notes it.
    model.scale.data = torch.full((1,), 0.5)
    model.zero_grad()
    notes.refresh()
    _backward(model)
    assert model.scale.grad is not None and model.scale.grad.shape == (1,)
    assert sum(p is model.scale for p in notes) == 1 and len(notes) == 3
    notes.clear()
    # Another dtype: torch makes a new accumulator, without the hook, until refreshed.
    model.double()
    model.zero_grad()
    notes.refresh()
    model(torch.randn(5, 4, dtype=torch.float64)).pow(2).sum().backward()
    assert {id(p) for p in notes} == {id(p) for p in params} and len(notes) == 3


def test_fused_views_checks_match_what_python_checks(native):
    model = _model()
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    views = [v.view(p.shape) for v, p in
             zip(flat.split([p.numel() for p in params]), params, strict=True)]
    for p, v in zip(params, views, strict=True):
        p.grad = v
    checks = native.FusedViews(params, views, [p.shape for p in params],
                               [v.data_ptr() for v in views])
    assert checks.views_except([]) and checks.views_in_place() and checks.same_shapes()
    assert not checks.same_data()  # nothing noted yet
    checks.note_data()
    assert checks.same_data()
    params[1].grad = None
    assert not checks.views_except([]) and checks.views_except([1])
    params[2].grad = torch.zeros_like(params[2])  # a gradient, but not its view
    assert not checks.views_except([1])
    params[0].data = params[0].data.clone()  # new data, the same shape
    assert not checks.same_data() and checks.same_shapes()
    params[0].data = torch.zeros(2, 6)  # another shape
    assert not checks.same_shapes()
    model.double()  # a conversion gives the parameters and their gradients new storage
    assert not checks.same_data() and not checks.views_in_place()


def test_the_source_ships_in_the_package():
    root = Path(__file__).resolve().parents[2]
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    assert "hora_torch_hooks.cpp" in pyproject["tool"]["setuptools"]["package-data"]["hora.torch"]
    assert (root / "client_sdk/hora/torch/hora_torch_hooks.cpp").exists()


def test_what_the_cpp_side_holds_does_not_keep_a_model_alive(native):
    model = _model()
    params = list(model.parameters())
    views = [torch.zeros_like(p) for p in params]
    checks = native.FusedViews(params, views, [p.shape for p in params],
                               [v.data_ptr() for v in views])
    notes = NativeNotes(native, params)
    notes.hook(params, skip=0)
    gone = weakref.ref(params[1])
    del model, params, notes
    gc.collect()
    assert gone() is None
    assert not checks.same_shapes()  # a parameter that is gone fails every check
