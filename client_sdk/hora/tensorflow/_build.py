"""Builds hora's TensorFlow op library (``hora_tf_ops.cc``) against the installed TensorFlow.

TensorFlow's custom ops must be compiled against the very TensorFlow that
loads them, so the library is built on first use, into a cache directory
keyed by a hash of the source, TensorFlow's version and its flags. Several
ranks start at once on one machine: a file lock lets one of them compile
while the others wait, and the library appears under its final name in one
rename.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import tensorflow as tf

__all__ = ["BuildError", "library_path"]

SOURCE = Path(__file__).with_name("hora_tf_ops.cc")
# Compiling against TensorFlow's headers takes 15-60 s on a loaded machine.
COMPILE_TIMEOUT_S = 600


class BuildError(RuntimeError):
    """The op library could not be built (no C++ compiler, or it failed)."""


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hora" / "tf_ops"


def _command(source: Path, output: Path) -> list[str]:
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        raise BuildError(
            "hora's TensorFlow graph ops must be compiled on first use and no C++ compiler "
            "was found (install g++, or set CXX)")
    return [compiler, "-shared", "-fPIC", "-O2", "-w", *tf.sysconfig.get_compile_flags(),
            str(source), "-o", str(output), *tf.sysconfig.get_link_flags()]


def library_path() -> Path:
    """The built library, compiling it first if this TensorFlow has none yet.

    Raises:
        BuildError: no compiler, or the compilation failed (its output is in the message).
    """
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([
        source, tf.__version__.encode(), tf.__git_version__.encode(),
        " ".join(tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()).encode(),
    ])).hexdigest()[:16]
    folder = _cache_root() / key
    target = folder / "hora_tf_ops.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be compiling it right now
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=folder) as work:
            staged = Path(work) / "hora_tf_ops.cc"
            staged.write_bytes(source)
            built = Path(work) / "hora_tf_ops.so"
            try:
                proc = subprocess.run(_command(staged, built), capture_output=True, text=True,
                                      timeout=COMPILE_TIMEOUT_S, check=False)
            except subprocess.TimeoutExpired as exc:
                raise BuildError(f"compiling {SOURCE.name} took over {COMPILE_TIMEOUT_S} s"
                                 ) from exc
            if proc.returncode != 0 or not built.exists():
                raise BuildError(f"compiling {SOURCE.name} against TensorFlow {tf.__version__} "
                                 f"failed:\n{proc.stderr[-4000:]}")
            os.replace(built, target)
    return target
