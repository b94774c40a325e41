"""Builds a C++ library that ships as source, once per machine, into a cache.

hora ships two small C++ sources that must be compiled against the framework
that loads them: TensorFlow's graph ops (``hora/tensorflow/hora_tf_ops.cc``)
and the PyTorch optimizer's gradient hooks (``hora/torch/hora_torch_hooks.cpp``).
Each is built on first use into a folder keyed by a hash of the source and of
what it is compiled against. Several ranks start at once on one machine: a
file lock lets one of them compile while the others wait, and the library
appears under its final name in one rename, so that no rank loads half a file.
A compilation that failed leaves its error in the folder, and is not tried
again by every rank of every job.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["COMPILE_TIMEOUT_S", "BuildError", "build_once", "compiler"]

# Compiling against a framework's headers takes 15-60 s on a loaded machine.
COMPILE_TIMEOUT_S = 600


class BuildError(RuntimeError):
    """A library could not be built (no C++ compiler, or it failed)."""


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hora"


def compiler(what: str) -> str:
    """The C++ compiler (``$CXX``, else g++ or c++).

    Raises:
        BuildError: none is installed; ``what`` says what needed one.
    """
    found = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if found is None:
        raise BuildError(f"{what} must be compiled on first use and no C++ compiler was "
                         f"found (install g++, or set CXX)")
    return found


def build_once(kind: str, source: Path, output_name: str, key: Sequence[bytes],
               command: Callable[[Path, Path], list[str]]) -> Path:
    """The library built from ``source``, compiling it first when the cache has
    none for this ``key`` (what the build depends on besides the source).

    ``kind`` names the cache's subfolder; ``command(source, output)`` is the
    compiler's command line, given a copy of the source and where to write.

    Raises:
        BuildError: no compiler, or the compilation failed (its output is in the message).
    """
    text = source.read_bytes()
    digest = hashlib.sha256(b"\0".join([text, *key])).hexdigest()[:16]
    folder = _cache_root() / kind / digest
    target = folder / output_name
    failed = folder / "build.failed"  # a compilation that failed is not tried again
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be compiling it right now
        if target.exists():
            return target
        if failed.exists():
            raise BuildError(f"{failed.read_text()}\n(delete {folder} to try again)")
        with tempfile.TemporaryDirectory(dir=folder) as work:
            staged = Path(work) / source.name
            staged.write_bytes(text)
            built = Path(work) / output_name
            try:
                proc = subprocess.run(command(staged, built), capture_output=True, text=True,
                                      timeout=COMPILE_TIMEOUT_S, check=False)
            except subprocess.TimeoutExpired as exc:
                raise BuildError(f"compiling {source.name} took over {COMPILE_TIMEOUT_S} s"
                                 ) from exc
            if proc.returncode != 0 or not built.exists():
                message = f"compiling {source.name} failed:\n{proc.stderr[-4000:]}"
                failed.write_text(message)
                raise BuildError(message)
            os.replace(built, target)
    return target
