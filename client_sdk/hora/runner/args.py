"""Command line of ``horarun``: flags in, a frozen :class:`LaunchConfig` out.

Flags follow horovodrun's spelling so that a Horovod user's command line
works unchanged, elastic ones included (``--min-np``, ``--max-np``,
``--host-discovery-script``, ...): any of ``--min-np``, ``--max-np`` or
``--host-discovery-script`` makes the job elastic (:class:`.elastic_actions.ElasticPolicy`).
Option parsing stops at the first positional argument: that and everything
after it is the worker command, its own ``--flags`` included.

The parser and the check of each value are in :mod:`.flags`; horovodrun's
flags without effect and its ``--config-file`` in :mod:`.horovod_flags`.
Here the values are checked together and become a :class:`LaunchConfig`.
"""

from __future__ import annotations

import argparse
import os
import secrets
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from hora._tls import read_ca_bundle
from hora.settings import Settings, SettingsError
from hora_proto.options import BY_FIELD, ELASTIC_GROUP, OPTIONS, flag_value

from .elastic_actions import ElasticPolicy
from .flags import build_parser, parse_address
from .horovod_flags import apply_config_file, ignored_flag_notices

__all__ = ["ElasticPolicy", "LaunchConfig", "build_parser", "parse_args", "parse_address"]


@dataclass(frozen=True)
class LaunchConfig:
    """What one ``horarun`` invocation was asked to do.

    Attributes:
        num_proc: world size (elastic: the number of workers started first).
        hosts_arg: the ``-H`` value, or None.
        hostfile: the ``--hostfile`` path, or None.
        coordinator: ``HOST:PORT`` of a running coordinator, or None to embed one.
        coordinator_http_port: HTTP port of the embedded coordinator (0: ephemeral).
        job_id: job the workers join.
        token: job token.
        token_made_up: whether ``token`` is a random one of this launcher's (no
            ``--token`` nor ``$HORA_TOKEN``).
        tls: embed a coordinator serving TLS, with a CA made for this job (``--tls``).
        tls_ca: the PEM text of the CA bundle that verifies the ``--coordinator``'s
            certificate (``--tls-ca``), or empty for plaintext.
        worker_settings: :class:`hora.settings.Settings` fields given by flags,
            by field name; only these are passed on besides the per-rank ones.
        verbose: print the placement before starting.
        output_dir: also write each rank's output below this directory.
        prefix: prefix every output line with the rank.
        horovod_compat: put the ``horovod`` import shim on the workers' path.
        command: the worker command and its arguments.
        elastic: the elastic job's limits and host source; None for a fixed world.
        network_interface: the interface every machine of the job listens on
            (``--network-interface``), or None to pick the one that routes to
            the coordinator.
        ssh_port: ssh port for remote hosts, or None for ssh's default.
        ssh_identity_file: ssh private key for remote hosts, or None.
        prefix_timestamp: start every output line with the time it was read
            (horovodrun's ``--prefix-output-with-timestamp``).
        worker_env: variables set in every worker's environment for the
            libraries below hora (``NCCL_IB_DISABLE`` for ``--tcp``).
        notices: one line each for what was accepted but has no effect on
            hora, saying why; the launcher prints them.
    """

    num_proc: int
    command: tuple[str, ...]
    hosts_arg: str | None = None
    hostfile: str | None = None
    coordinator: str | None = None
    coordinator_http_port: int = 0
    job_id: str = ""
    token: str = ""
    token_made_up: bool = False
    tls: bool = False
    tls_ca: str = ""
    worker_settings: Mapping[str, Any] = field(default_factory=dict)
    verbose: bool = False
    output_dir: str | None = None
    prefix: bool = True
    horovod_compat: bool = False
    elastic: ElasticPolicy | None = None
    network_interface: str | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    prefix_timestamp: bool = False
    worker_env: Mapping[str, str] = field(default_factory=dict)
    notices: tuple[str, ...] = ()


def parse_args(argv: Sequence[str] | None = None,
               environ: Mapping[str, str] | None = None, *, prog: str = "horarun",
               horovod_compat: bool = False) -> LaunchConfig:
    """Parses ``horarun``'s command line.

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).
        environ: environment for defaults such as ``HORA_TOKEN`` (default
            ``os.environ``).
        prog: the program name shown in usage messages.
        horovod_compat: the default of ``--horovod-compat``.

    Returns:
        The launch configuration.

    Raises:
        SystemExit: with code 2 and a usage message on stderr when the
            command line is invalid (argparse's convention).
    """
    env = os.environ if environ is None else environ
    parser = build_parser(prog, horovod_compat)
    ns = parser.parse_args(argv)
    for flag in ("mpi", "jsrun"):
        if getattr(ns, flag):
            parser.error(f"--{flag}: hora starts its workers itself and runs collectives "
                         f"over Gloo (NCCL on GPUs), never through {flag}run; drop --{flag}, "
                         f"or run this job with Horovod's own horovodrun")
    from_file: dict[str, str] = {}
    file_notices: list[str] = []
    if ns.config_file is not None:
        file_notices = apply_config_file(parser, ns, ns.config_file, from_file)
    notices = ignored_flag_notices(ns, from_file)
    notices += file_notices

    command = list(ns.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("no command given (e.g. horarun -np 2 python train.py)")

    elastic = _elastic_config(parser, ns)
    if elastic is None:
        if ns.num_proc is None:
            parser.error("the following arguments are required: -np/--num-proc")
        num_proc = ns.num_proc
    else:
        num_proc = ns.num_proc if ns.num_proc is not None else elastic.min_np

    settings: dict[str, Any] = {}
    if elastic is not None:
        settings["min_size"] = elastic.min_np
        if elastic.max_np is not None:
            settings["max_size"] = elastic.max_np
        settings["elastic_timeout"] = elastic.elastic_timeout
        if elastic.reset_limit is not None:
            settings["reset_limit"] = elastic.reset_limit
    settings.update(_worker_settings(ns))
    try:
        # The same validation a worker will apply, so a bad flag fails here
        # once rather than in N workers.
        Settings(size=num_proc, rank=0, **settings).validate()
    except SettingsError as exc:
        parser.error(str(exc))

    if ns.no_stall_check:
        settings["stall_warning_time"] = timedelta(0)
        settings["stall_shutdown_time"] = timedelta(0)
    token = ns.token or env.get("HORA_TOKEN") or secrets.token_hex(16)
    tls_ca = _tls_ca(parser, ns, env)
    job_id = ns.job_id or f"job-{uuid.uuid4().hex[:12]}"
    return LaunchConfig(
        num_proc=num_proc,
        command=tuple(command),
        hosts_arg=ns.hosts,
        hostfile=ns.hostfile,
        coordinator=ns.coordinator,
        coordinator_http_port=ns.coordinator_http_port,
        job_id=job_id,
        token=token,
        token_made_up=not (ns.token or env.get("HORA_TOKEN")),
        tls=ns.tls,
        tls_ca=tls_ca,
        worker_settings=settings,
        verbose=ns.verbose,
        output_dir=ns.output_filename,
        prefix=not ns.disable_prefix,
        horovod_compat=ns.horovod_compat,
        elastic=elastic,
        network_interface=ns.network_interface,
        ssh_port=ns.ssh_port,
        ssh_identity_file=ns.ssh_identity_file,
        prefix_timestamp=ns.prefix_timestamp,
        # Horovod's --tcp: NCCL must not use InfiniBand.
        worker_env={"NCCL_IB_DISABLE": "1"} if ns.tcp else {},
        notices=tuple(notices),
    )


def _worker_settings(ns: argparse.Namespace) -> dict[str, Any]:
    """The settings the table's flags gave (the elastic ones aside: see
    :func:`_elastic_config`), by field, in the settings' units."""
    settings: dict[str, Any] = {}
    for option in OPTIONS:
        flag = option.flag
        if flag is None or flag.group == ELASTIC_GROUP:
            continue
        value = getattr(ns, flag.dest)
        # A switch's off is its default: only an inverted one says something.
        if value is None or value == "" or (value is False and not flag.invert):
            continue
        settings[option.field] = flag_value(option, value)
    return settings


def _tls_ca(parser: argparse.ArgumentParser, ns: argparse.Namespace,
            env: Mapping[str, str]) -> str:
    """The PEM text of the ``--coordinator``'s CA bundle (``--tls-ca``, else
    ``$HORA_TLS_CA``), or empty for plaintext; read here, so that workers on
    other machines need no copy of the file.

    Raises:
        SystemExit: (via ``parser.error``) TLS flags that do not fit together,
            or a bundle that cannot be read.
    """
    if ns.tls and ns.coordinator is not None:
        parser.error("--tls makes certificates for the embedded coordinator; a running "
                     "--coordinator that serves TLS needs --tls-ca FILE, the CA that signed "
                     "its certificate")
    if ns.tls_ca is not None and ns.coordinator is None:
        parser.error("--tls-ca verifies a running coordinator (--coordinator HOST:PORT); "
                     "for the embedded one, --tls makes the certificates")
    if ns.coordinator is None:
        return ""  # $HORA_TLS_CA is for a running coordinator only
    source, value = ("--tls-ca", ns.tls_ca) if ns.tls_ca is not None else \
        ("HORA_TLS_CA", env.get("HORA_TLS_CA", ""))
    if not value:
        return ""
    try:
        return read_ca_bundle(value).decode("ascii", errors="replace")
    except ValueError as exc:
        parser.error(f"{source}: {exc}")


_ELASTIC_ONLY = (
    ("slots_per_host", "--slots-per-host"),
    ("reset_limit", "--reset-limit"),
    ("blacklist_cooldown_range", "--blacklist-cooldown-range"),
    ("elastic_timeout", "--elastic-timeout"),
)


def _elastic_config(parser: argparse.ArgumentParser,
                    ns: argparse.Namespace) -> ElasticPolicy | None:
    """The elastic part of the command line, or None for a fixed world.

    Raises:
        SystemExit: (via ``parser.error``) the elastic flags contradict
            each other or are given to a job that is not elastic.
    """
    script = ns.host_discovery_script
    if script is None and ns.min_np is None and ns.max_np is None:
        for dest, flag in _ELASTIC_ONLY:
            if getattr(ns, dest) is not None:
                parser.error(f"{flag} applies to elastic jobs only; add --min-np/--max-np "
                             f"or --host-discovery-script")
        return None

    if script is not None and not script.strip():
        parser.error("--host-discovery-script: empty command")
    if script is None and ns.hosts is None and ns.hostfile is None:
        # horovodrun's rule, relaxed: a fixed -H/--hostfile list also works.
        parser.error("an elastic job (--min-np/--max-np) needs --host-discovery-script, "
                     "or a fixed host list with -H or --hostfile")
    if script is None and ns.slots_per_host is not None:
        parser.error("--slots-per-host applies to --host-discovery-script only; "
                     "give slots in -H as HOST:SLOTS")
    min_np = ns.min_np if ns.min_np is not None else ns.num_proc
    if min_np is None:
        parser.error("an elastic job needs --min-np or -np")
    max_np = ns.max_np
    if max_np is not None and min_np > max_np:
        parser.error(f"--min-np {min_np} is larger than --max-np {max_np}")
    num_proc = ns.num_proc if ns.num_proc is not None else min_np
    if num_proc < min_np:
        parser.error(f"-np {num_proc} is below --min-np {min_np}")
    if max_np is not None and num_proc > max_np:
        parser.error(f"-np {num_proc} is above --max-np {max_np}")
    cooldown = None
    if ns.blacklist_cooldown_range is not None:
        low, high = ns.blacklist_cooldown_range
        if low > high:
            parser.error(f"--blacklist-cooldown-range: MIN {low:g} is larger than "
                         f"MAX {high:g}")
        cooldown = (timedelta(seconds=low), timedelta(seconds=high))
    timeout = BY_FIELD["elastic_timeout"]
    return ElasticPolicy(
        min_np=min_np,
        max_np=max_np,
        discovery_script=script,
        slots_per_host=ns.slots_per_host if ns.slots_per_host is not None else 1,
        reset_limit=ns.reset_limit,
        cooldown_range=cooldown,
        elastic_timeout=(timeout.default if ns.elastic_timeout is None
                         else flag_value(timeout, ns.elastic_timeout)),
    )
