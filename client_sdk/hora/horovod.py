"""``python -m hora.horovod script.py [args]``: a Horovod driver script, unchanged, on hora.

A script that says ``from horovod.ray import RayExecutor`` or ``import
horovod.spark`` is started with plain ``python``, not ``horovodrun``. This
puts hora's ``horovod`` shim first on the path of the script, and on the
``PYTHONPATH`` of every process it starts; the Ray actors and Spark tasks
that hora starts put it on their own path too. A real Horovod that is
installed is never shadowed: the script is refused, saying where it is.
"""

from __future__ import annotations

import os
import runpy
import sys

from hora._compat import real_horovod_location, shim_path

__all__ = ["main"]


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m hora.horovod SCRIPT.py [ARGS...]\n"
              "Runs a Horovod driver script (horovod.ray, horovod.spark, horovod.torch) on "
              "hora.", file=sys.stderr)
        return 0 if argv else 2
    real = real_horovod_location()
    if real is not None:
        print(f"hora.horovod: a real Horovod is installed ({real}); hora will not shadow it. "
              f"Run the script with plain python to use it, or uninstall it to use hora.",
              file=sys.stderr)
        return 2
    shim = shim_path()
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([shim, *paths])
    sys.path.insert(0, shim)
    script = argv[0]
    sys.argv = list(argv)
    # As `python script.py` would: the script's folder first on the path.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
