"""``horarun``: start a coordinator and N workers, and supervise them.

    horarun -np 2 python train.py --epochs 3

Steps: parse the command line (:mod:`.args`), place ranks on hosts
(:mod:`.hosts`), embed a coordinator unless ``--coordinator`` names one,
build each worker's environment (:mod:`.env`), then start and supervise the
workers (:mod:`.procs`). Exit codes: 0 when all workers succeed, the first
failing worker's code otherwise (128+N for signal N), 130/143 when
``horarun`` is interrupted, 2 for usage errors, 1 when the embedded
coordinator cannot start.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from .args import LaunchConfig, parse_args
from .env import worker_environment
from .hosts import (
    HostError,
    HostSlots,
    SlotInfo,
    assign_ranks,
    is_local_host,
    parse_hostfile,
    parse_hosts,
)
from .procs import Supervisor, WorkerSpec

__all__ = ["horovodrun_main", "main", "resolve_hosts"]

USAGE_ERROR = 2
COORDINATOR_ERROR = 1


class _UsageError(Exception):
    """A request that parses but cannot be carried out as given (exit 2)."""


def _err(message: str) -> None:
    print(f"horarun: {message}", file=sys.stderr, flush=True)


def resolve_hosts(config: LaunchConfig) -> list[HostSlots]:
    """The hosts to run on: ``-H``, ``--hostfile``, or ``localhost`` with N slots.

    Raises:
        HostError: the host list or hostfile is malformed or unreadable.
    """
    if config.hosts_arg is not None:
        return parse_hosts(config.hosts_arg)
    if config.hostfile is not None:
        try:
            with open(config.hostfile, encoding="utf-8") as f:
                return parse_hostfile(f, name=config.hostfile)
        except OSError as exc:
            raise HostError(f"--hostfile: cannot read {config.hostfile!r}: "
                            f"{exc.strerror or exc}") from exc
    return [HostSlots("localhost", config.num_proc)]


def _placement(config: LaunchConfig) -> list[SlotInfo]:
    try:
        slots = assign_ranks(resolve_hosts(config), config.num_proc)
    except HostError as exc:
        raise _UsageError(str(exc)) from exc
    remote = sorted({s.hostname for s in slots if not is_local_host(s.hostname)})
    if remote:
        named = (f"host {remote[0]} is" if len(remote) == 1
                 else f"hosts {', '.join(remote)} are")
        raise _UsageError(
            f"{named} not this machine; horarun can only start "
            f"workers locally for now (remote launch over ssh is not implemented). "
            f"Local hosts: localhost, 127.x.x.x, or this machine's name"
        )
    return slots


def _start_coordinator(config: LaunchConfig) -> Any:
    # Imported here, not at module level: a broken coordinator must not stop
    # `horarun --coordinator HOST:PORT`, nor hide a launcher bug.
    from hora_coordinator.server import EmbeddedCoordinator
    from hora_coordinator.settings import CoordinatorSettings

    coordinator = EmbeddedCoordinator(CoordinatorSettings(
        host="127.0.0.1",
        grpc_port=0,
        http_port=config.coordinator_http_port,
        token=config.token,
    ))
    coordinator.start()
    return coordinator


def _compat_env(base: dict[str, str]) -> dict[str, str]:
    """Puts the ``horovod`` shim first on the workers' ``PYTHONPATH``.

    Raises:
        _UsageError: a real Horovod is installed; shadowing it silently would
            run the user's script on something they did not choose.
    """
    from hora._compat import real_horovod_location, shim_path

    real = real_horovod_location()
    if real is not None:
        raise _UsageError(
            f"a real Horovod is installed ({real}); hora will not shadow it. Run it with "
            f"its own horovodrun, or change the script to `import hora.torch as hvd` and "
            f"use horarun without --horovod-compat")
    paths = [shim_path()] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**base, "PYTHONPATH": os.pathsep.join(paths)}


def _specs(config: LaunchConfig, slots: Sequence[SlotInfo], coordinator: str) -> list[WorkerSpec]:
    base = dict(os.environ)
    if config.horovod_compat:
        base = _compat_env(base)
    return [
        WorkerSpec(
            rank=slot.rank,
            hostname=slot.hostname,
            argv=config.command,
            env=worker_environment(
                base, slot,
                coordinator=coordinator,
                job_id=config.job_id,
                token=config.token,
                worker_settings=config.worker_settings,
                horovod_env=config.horovod_env,
            ),
        )
        for slot in slots
    ]


def horovodrun_main(argv: Sequence[str] | None = None) -> int:
    """Runs ``horovodrun``: ``horarun`` with the ``horovod`` import shim on by default."""
    return main(argv, prog="horovodrun", horovod_compat=True)


def main(argv: Sequence[str] | None = None, *, prog: str = "horarun",
         horovod_compat: bool = False) -> int:
    """Runs ``horarun``.

    Args:
        argv: the arguments after the program name (default ``sys.argv[1:]``).
        prog: the program name in messages.
        horovod_compat: the default of ``--horovod-compat``.

    Returns:
        The process exit code (see the module docstring).
    """
    try:
        config = parse_args(argv, prog=prog, horovod_compat=horovod_compat)
    except SystemExit as exc:
        # argparse has printed usage already; return rather than raise so
        # callers embedding main() get a code, not an exception.
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR

    try:
        slots = _placement(config)
    except _UsageError as exc:
        _err(f"error: {exc}")
        return USAGE_ERROR

    if config.verbose:
        for slot in slots:
            _err(f"rank {slot.rank} on {slot.hostname} (local {slot.local_rank}/"
                 f"{slot.local_size}, cross {slot.cross_rank}/{slot.cross_size})")

    coordinator = None
    address = config.coordinator
    try:
        if address is None:
            try:
                coordinator = _start_coordinator(config)
            except Exception as exc:  # any failure here means "cannot embed"
                _err(f"error: cannot start the embedded coordinator: "
                     f"{type(exc).__name__}: {exc}; start one with hora-coordinator "
                     f"and pass --coordinator HOST:PORT")
                return COORDINATOR_ERROR
            address = coordinator.grpc_address
            _err(f"coordinator gRPC {address}, HTTP http://127.0.0.1:{coordinator.http_port}, "
                 f"job {config.job_id}")
        # With --coordinator, workers may start before it is reachable; they
        # retry within their connect timeout, so no check is made here.
        try:
            specs = _specs(config, slots, address)
        except _UsageError as exc:
            _err(f"error: {exc}")
            return USAGE_ERROR
        return Supervisor(specs, prefix=config.prefix, output_dir=config.output_dir).run()
    except KeyboardInterrupt:
        # Ctrl-C before the workers (and our handlers) were in place.
        return 130
    finally:
        if coordinator is not None:
            coordinator.stop()

if __name__ == "__main__":
    sys.exit(main())
