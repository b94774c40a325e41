"""One worker of :func:`hora.runner.run_func.run`: ``python -m hora.runner.run_task DIR``.

Loads the pickled function from ``DIR``, calls it, and leaves its return
value (or the exception it raised, with the traceback as text) in ``DIR``
under this worker's rank; exits 1 after an exception.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import cloudpickle

from hora.settings import Settings

from .run_func import FUNC_FILE, error_file, result_file


def _write(path: Path, value: object) -> None:
    # Written aside, then renamed: the caller never reads half a file.
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        cloudpickle.dump(value, f)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m hora.runner.run_task DIR", file=sys.stderr)
        return 2
    directory = Path(argv[0])
    # The rank the launcher assigned (a fixed world): settings are the one
    # place a worker reads its environment.
    rank = Settings.from_env().rank
    with open(directory / FUNC_FILE, "rb") as f:
        func, args, kwargs = cloudpickle.load(f)
    try:
        value = func(*args, **kwargs)
    except BaseException as exc:
        trace = traceback.format_exc()
        _write(error_file(directory, rank), (type(exc).__name__, str(exc), trace))
        sys.stderr.write(trace)
        return 1
    _write(result_file(directory, rank), value)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
