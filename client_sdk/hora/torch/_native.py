"""The DistributedOptimizer's C++ helpers (``hora_torch_hooks.cpp``), built on first use.

A fused step (:mod:`._fused`) spends most of hora's own time per step on
Python that runs once per parameter: the noting hooks autograd calls as each
gradient is accumulated, and the checks that every gradient is still its
view of the buffer. On section 2c's 400 parameters (bench/README.md,
"Eighteenth pass") they cost 0.45-2.1 ms a step in Python, nothing measurable
in C++; hora's step is 0.1-0.7 ms shorter with them.

The source ships in the package and is compiled against the installed torch
the first time an optimizer needs it (``make install`` does it ahead), into
``~/.cache/hora/torch_hooks`` (:mod:`hora._native_build`: one rank compiles
while the others wait). Where no C++ compiler is installed, or
``HORA_NATIVE_HOOKS=0``, the optimizer uses its Python hooks and checks,
which behave the same.

    python -c 'import hora.torch._native as n; n.prebuild()'  # builds it now
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import sysconfig
import threading
from pathlib import Path
from types import ModuleType

import torch

from .. import _runtime
from .._native_build import BuildError, build_once, compiler
from ..settings import Settings

__all__ = ["build", "hooks_module", "prebuild"]

_log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("hora_torch_hooks.cpp")
_NAME = "hora_torch_hooks"

_lock = threading.Lock()
_module: ModuleType | None = None
_failed: str | None = None  # why it could not be built or loaded, once tried


def _command(source: Path, output: Path) -> list[str]:
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return [compiler("hora's gradient hooks"), "-shared", "-fPIC", "-O2", "-w", "-std=c++20",
            f"-DTORCH_EXTENSION_NAME={_NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{folder}" for folder in includes), str(source), "-o", str(output),
            *(f"-L{folder}" for folder in cpp_extension.library_paths()),
            "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]


def build() -> ModuleType:
    """Builds (unless cached) and loads the module.

    Raises:
        BuildError: no compiler, or the compilation failed.
        OSError: the cache cannot be written.
        ImportError: the library does not load.
    """
    headers = Path(sysconfig.get_paths()["include"])
    if not (headers / "Python.h").exists():
        raise BuildError(f"hora's gradient hooks need Python's C headers, not found in "
                         f"{headers} (Debian: python3-dev)")
    # (The command names the compiler, the flags, torch's and Python's folders.)
    key = [torch.__version__.encode(), " ".join(_command(SOURCE, Path(_NAME))).encode()]
    path = build_once("torch_hooks", SOURCE, f"{_NAME}.so", key, _command)
    loader = importlib.machinery.ExtensionFileLoader(_NAME, str(path))
    spec = importlib.util.spec_from_file_location(_NAME, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def hooks_module() -> ModuleType | None:
    """The built module, building it on the first call; None where it cannot
    be built or loaded (said once, in the log) or ``HORA_NATIVE_HOOKS=0``."""
    global _module, _failed
    runtime = _runtime._runtime
    if not (runtime.settings if runtime is not None else Settings.from_env()).native_hooks:
        return None
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                _module = build()
            except (BuildError, OSError, ImportError) as exc:
                _failed = str(exc)
                _log.info("hora: the optimizer's gradient hooks stay in Python: %s", exc)
    return _module


def prebuild() -> None:
    """Builds the module now (``make install`` does), saying where or why not."""
    try:
        built = build()
    except (BuildError, OSError, ImportError) as exc:
        print(f"hora: the gradient hooks were not built; Python's are used: {exc}")
    else:
        print(f"hora: gradient hooks built: {built.__file__}")
