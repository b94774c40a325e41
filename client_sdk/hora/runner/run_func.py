"""``hora.run`` (``horovod.run``): run a Python function on N workers, get each rank's result.

The function and its arguments are pickled with cloudpickle into a private
folder; ``horarun``'s own machinery (:func:`hora.runner.launch.main`, with
its embedded coordinator) starts N workers that each run
:mod:`hora.runner.run_task`, which calls the function and pickles its
return value, or the exception it raised, back into the folder. The
function calls ``hvd.init()`` itself, as in Horovod's documentation.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import cloudpickle

from .launch import main

__all__ = ["RunFuncError", "run"]

FUNC_FILE = "func.pkl"


def result_file(directory: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` leaves its return value."""
    return Path(directory) / f"result.{rank}.pkl"


def error_file(directory: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` leaves the exception its function raised."""
    return Path(directory) / f"error.{rank}.pkl"


class RunFuncError(RuntimeError):
    """A rank of :func:`run` failed; the message names the rank and its error.

    Attributes:
        rank: the lowest failing rank, or None when no rank said why (a
            worker killed, or the job never started).
        exit_code: ``horarun``'s exit code.
    """

    def __init__(self, message: str, rank: int | None, exit_code: int) -> None:
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code


def run(func: Callable[..., Any], args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None, np: int = 1, *,
        min_np: int | None = None, max_np: int | None = None,
        hosts: str | None = None, hostfile: str | None = None,
        start_timeout: float | None = None, ssh_port: int | None = None,
        ssh_identity_file: str | None = None, disable_cache: bool | None = None,
        output_filename: str | None = None, verbose: bool | int | None = None,
        use_gloo: bool | None = None, use_mpi: bool | None = None,
        mpi_args: str | None = None, network_interface: str | None = None,
        executable: str | None = None, prefix_output_with_timestamp: bool = False,
        horovod_compat: bool = False, **unsupported: Any) -> list[Any]:
    """Runs ``func(*args, **kwargs)`` on ``np`` workers and returns their results.

    Horovod's ``horovod.run``: the same arguments, a list of every rank's
    return value in rank order. Workers' output is forwarded, prefixed by
    rank, as with ``horarun``.

    Args:
        func: the function; it calls ``hvd.init()`` itself. Pickled with
            cloudpickle, so closures and lambdas work.
        args: its positional arguments.
        kwargs: its keyword arguments.
        np: number of workers (Horovod's ``num_proc``).
        min_np, max_np: elastic limits; not supported by hora's ``run``.
        hosts: ``-H`` host list, e.g. ``"localhost:2"``.
        hostfile: ``--hostfile``.
        start_timeout: seconds the workers may take to gather.
        ssh_port, ssh_identity_file: for remote hosts.
        disable_cache: accepted (hora keeps no cache of launcher checks).
        output_filename: also write each rank's output below this folder.
        verbose: print the placement of ranks.
        use_gloo: accepted (hora always uses Gloo).
        use_mpi: refused when true (hora never uses MPI).
        mpi_args: accepted and ignored (MPI only).
        network_interface: the interface every machine listens on.
        executable: Python interpreter of the workers (default: this one).
        prefix_output_with_timestamp: start output lines with the time.
        horovod_compat: put the ``horovod`` import shim on the workers' path
            (``horovod.run`` does).

    Returns:
        ``[rank 0's return value, rank 1's, ...]``.

    Raises:
        ValueError: an argument hora cannot honour (elastic limits, MPI,
            an unknown keyword).
        RunFuncError: a rank raised (its exception type, message and
            traceback are in the message), died, or the job did not start.
    """
    if unsupported:
        raise ValueError(f"hora.run does not take {', '.join(sorted(unsupported))}")
    if min_np is not None or max_np is not None:
        raise ValueError("hora.run runs a fixed world of np workers; min_np/max_np (elastic) "
                         "are not supported here, use horarun with --min-np/--max-np")
    if use_mpi:
        raise ValueError("use_mpi=True: hora never runs through MPI; leave it unset")
    if np < 1:
        raise ValueError(f"np must be at least 1, got {np}")
    argv = ["-np", str(np)]
    if hosts is not None:
        argv += ["-H", hosts]
    if hostfile is not None:
        argv += ["--hostfile", hostfile]
    if start_timeout is not None:
        argv += ["--start-timeout", str(start_timeout)]
    if ssh_port is not None:
        argv += ["--ssh-port", str(ssh_port)]
    if ssh_identity_file is not None:
        argv += ["--ssh-identity-file", ssh_identity_file]
    if output_filename is not None:
        argv += ["--output-filename", output_filename]
    if verbose:
        argv.append("--verbose")
    if network_interface is not None:
        argv += ["--network-interface", network_interface]
    if prefix_output_with_timestamp:
        argv.append("--prefix-output-with-timestamp")
    argv.append("--horovod-compat" if horovod_compat else "--no-horovod-compat")

    # Workers on other machines run in the same working directory (shared,
    # as horarun expects), so the folder goes there when hosts are named.
    where = os.getcwd() if hosts is not None or hostfile is not None else None
    directory = tempfile.mkdtemp(prefix=".hora-run-", dir=where)
    try:
        with open(Path(directory) / FUNC_FILE, "wb") as f:
            cloudpickle.dump((func, tuple(args), dict(kwargs or {})), f)
        code = main([*argv, executable or sys.executable, "-m", "hora.runner.run_task",
                     directory])
        return _collect(directory, np, code)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _collect(directory: str, np: int, code: int) -> list[Any]:
    for rank in range(np):
        path = error_file(directory, rank)
        if path.exists():
            with open(path, "rb") as f:
                kind, message, trace = cloudpickle.load(f)
            raise RunFuncError(f"rank {rank} failed: {kind}: {message}\n{trace}", rank, code)
    results = []
    for rank in range(np):
        path = result_file(directory, rank)
        if not path.exists():
            raise RunFuncError(f"rank {rank} returned no result (horarun exited with code "
                               f"{code}; its output above says why)", None, code)
        with open(path, "rb") as f:
            results.append(cloudpickle.load(f))
    if code != 0:
        raise RunFuncError(f"every rank returned, but horarun exited with code {code}", None,
                           code)
    return results
