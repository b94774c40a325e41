"""Builds hora's TensorFlow op library (``hora_tf_ops.cc``) against the installed TensorFlow.

TensorFlow's custom ops must be compiled against the very TensorFlow that
loads them, so the library is built on first use, into a cache directory
keyed by a hash of the source, TensorFlow's version and its flags
(:mod:`hora._native_build`).
"""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf

from .._native_build import BuildError, build_once, compiler

__all__ = ["BuildError", "library_path"]

SOURCE = Path(__file__).with_name("hora_tf_ops.cc")


def _command(source: Path, output: Path) -> list[str]:
    return [compiler("hora's TensorFlow graph ops"), "-shared", "-fPIC", "-O2", "-w",
            *tf.sysconfig.get_compile_flags(), str(source), "-o", str(output),
            *tf.sysconfig.get_link_flags()]


def library_path() -> Path:
    """The built library, compiling it first if this TensorFlow has none yet.

    Raises:
        BuildError: no compiler, or the compilation failed (its output is in the message).
    """
    key = [tf.__version__.encode(), tf.__git_version__.encode(),
           " ".join(tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()).encode()]
    return build_once("tf_ops", SOURCE, "hora_tf_ops.so", key, _command)
