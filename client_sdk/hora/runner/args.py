"""Command line of ``horarun``: flags in, a frozen :class:`LaunchConfig` out.

Flags follow horovodrun's spelling so that a Horovod user's command line
works unchanged, elastic ones included (``--min-np``, ``--max-np``,
``--host-discovery-script``, ...): any of ``--min-np``, ``--max-np`` or
``--host-discovery-script`` makes the job elastic (:class:`ElasticConfig`). Option parsing stops at the first positional argument:
that and everything after it is the worker command, its own ``--flags``
included.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import secrets
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from hora.settings import LOG_LEVELS, MiB, Settings, SettingsError

__all__ = ["ElasticConfig", "LaunchConfig", "build_parser", "parse_args", "parse_address"]

# horovodrun's flags that ask for something hora does not have, and why it
# does not matter (by argparse dest). A flag set to False asks for nothing
# hora does not do anyway, so only True or a value draws the notice.
IGNORED = {
    "hierarchical_allreduce": "hora has no hierarchical allreduce; its data plane (shared "
                              "memory within a machine, Gloo or NCCL across) picks the "
                              "algorithm, and the results are the same",
    "hierarchical_allgather": "hora has no hierarchical allgather; its data plane picks the "
                              "algorithm, and the results are the same",
    "torus_allreduce": "hora has no torus allreduce; its data plane picks the algorithm, and "
                       "the results are the same",
    "num_nccl_streams": "hora does not take a number of NCCL streams; the results are the same",
    "thread_affinity": "hora does not pin its background thread to a core",
    "ccl_bgt_affinity": "hora does not use oneCCL's background thread",
    "binding_args": "process binding arguments are for mpirun, and hora does not use MPI",
    "mpi_args": "mpirun arguments are for MPI, and hora does not use MPI",
    "mpi_threads_disable": "MPI threading applies to MPI, and hora does not use MPI",
    "autotune_steps_per_sample": "hora's autotuner measures time windows, not step counts",
    "autotune_gaussian_process_noise": "hora's autotuner searches a grid instead of Bayesian "
                                       "optimization, so it has no noise parameter",
}

# horovodrun's --config-file (YAML): (section, key) -> argparse dest. A flag
# given on the command line wins over the file, wherever it stands.
CONFIG_KEYS = {
    ("params", "fusion_threshold_mb"): "fusion_threshold_mb",
    ("params", "cycle_time_ms"): "cycle_time_ms",
    ("params", "cache_capacity"): "cache_capacity",
    ("params", "hierarchical_allreduce"): "hierarchical_allreduce",
    ("params", "hierarchical_allgather"): "hierarchical_allgather",
    ("autotune", "enabled"): "autotune",
    ("autotune", "log_file"): "autotune_log_file",
    ("autotune", "warmup_samples"): "autotune_warmup_samples",
    ("autotune", "steps_per_sample"): "autotune_steps_per_sample",
    ("autotune", "bayes_opt_max_samples"): "autotune_bayes_opt_max_samples",
    ("autotune", "gaussian_process_noise"): "autotune_gaussian_process_noise",
    ("timeline", "filename"): "timeline_filename",
    ("timeline", "mark_cycles"): "timeline_mark_cycles",
    ("stall_check", "enabled"): "no_stall_check",  # inverted
    ("stall_check", "warning_time_seconds"): "stall_check_time",
    ("stall_check", "shutdown_time_seconds"): "stall_shutdown_time",
    ("library_options", "mpi_threads_disable"): "mpi_threads_disable",
    ("library_options", "num_nccl_streams"): "num_nccl_streams",
    ("library_options", "ccl_bgt_affinity"): "ccl_bgt_affinity",
    ("library_options", "gloo_timeout_seconds"): "gloo_timeout_seconds",
    ("logging", "level"): "log_level",
    ("logging", "with_timestamp"): "log_with_timestamp",
}


@dataclass(frozen=True)
class ElasticConfig:
    """How an elastic job may grow and shrink, and where its hosts come from.

    Attributes:
        min_np: fewest workers the job runs with.
        max_np: most workers the job runs with; None for no limit (workers
            are then not told a maximum).
        discovery_script: shell command printing ``host[:slots]`` lines, or
            None when the hosts are the fixed ``-H`` / ``--hostfile`` list.
        slots_per_host: slots of a discovered host printed without ``:slots``.
        reset_limit: elastic resets a worker may go through (None: no limit).
        cooldown_range: ``(MIN, MAX)`` of a blacklisted host's cooldown, or
            None to blacklist hosts for good.
        elastic_timeout: how long the job may stay below ``min_np`` workers
            (and how long the launcher waits for them at the start).
    """

    min_np: int
    max_np: int | None = None
    discovery_script: str | None = None
    slots_per_host: int = 1
    reset_limit: int | None = None
    cooldown_range: tuple[timedelta, timedelta] | None = None
    elastic_timeout: timedelta = timedelta(seconds=600)


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
    worker_settings: Mapping[str, Any] = field(default_factory=dict)
    verbose: bool = False
    output_dir: str | None = None
    prefix: bool = True
    horovod_compat: bool = False
    elastic: ElasticConfig | None = None
    network_interface: str | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    prefix_timestamp: bool = False
    worker_env: Mapping[str, str] = field(default_factory=dict)
    notices: tuple[str, ...] = ()


def parse_address(text: str) -> tuple[str, int]:
    """Splits ``HOST:PORT`` (``[v6]:PORT`` for IPv6 literals).

    Raises:
        ValueError: the text is not ``HOST:PORT`` with a port in 1..65535.
    """
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be in 1..65535, got {port}")
    return host, port


def _address(text: str) -> str:
    try:
        parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _hora_version() -> str:
    try:
        return importlib.metadata.version("hora")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def check_build_report() -> str:
    """What ``horovodrun --check-build`` prints, for this installation."""
    # Imported here: only this flag needs torch in the launcher.
    from hora.torch.mpi_ops import gloo_built, nccl_built

    def line(built: object, name: str) -> str:
        return f"    [{'X' if built else ' '}] {name}\n"

    return (f"hora v{_hora_version()} (Horovod API):\n\n"
            "Available Frameworks:\n" + line(False, "TensorFlow") + line(True, "PyTorch")
            + line(False, "MXNet") + "\nAvailable Controllers:\n" + line(False, "MPI")
            + line(gloo_built(), "Gloo") + "\nAvailable Tensor Operations:\n"
            + line(nccl_built(), "NCCL") + line(False, "DDL") + line(False, "CCL")
            + line(False, "MPI") + line(gloo_built(), "Gloo"))


class _CheckBuild(argparse.Action):
    """``-cb``: prints :func:`check_build_report` and exits 0, like ``--version``."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        sys.stdout.write(check_build_report())
        sys.stdout.flush()
        parser.exit(0)


def _interface(text: str) -> str:
    first = text.split(",")[0].strip()
    if not first:
        raise argparse.ArgumentTypeError(f"expected an interface name such as eth0, got {text!r}")
    return first


def _int_in(low: int, high: int | None, what: str, bounds: str) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (no upper bound when ``high`` is None)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{bounds}, got {value}")
        return value
    return parse


_positive_int = _int_in(1, None, "an integer", "must be at least 1")
_non_negative_int = _int_in(0, None, "an integer", "must be >= 0")
_port = _int_in(0, 65535, "a port number", "port must be in 0..65535")
_ssh_port = _int_in(1, 65535, "a port number", "port must be in 1..65535")


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _unit_float(text: str) -> float:
    value = _non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


def build_parser(prog: str = "horarun", horovod_compat: bool = False) -> argparse.ArgumentParser:
    """The ``horarun`` argument parser (``horovodrun``'s when ``horovod_compat``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} -np N [options] COMMAND [ARGS...]",
        description="Run a hora (Horovod API) training command on N worker processes.",
        epilog="Example: horarun -np 2 python train.py --epochs 3",
        allow_abbrev=False,
    )
    # Required unless the job is elastic; checked in parse_args.
    parser.add_argument("-np", "--num-proc", dest="num_proc", type=_positive_int,
                        metavar="N", help="number of worker processes (elastic: how many "
                                          "to start with; default --min-np)")

    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", dest="hosts", metavar="HOST:SLOTS,...",
                       help="hosts and their slots, e.g. 'h1:2,h2:2' (default: localhost:N)")
    hosts.add_argument("-hostfile", "--hostfile", dest="hostfile", metavar="FILE",
                       help="file with one 'HOST slots=N' or 'HOST:N' per line")
    hosts.add_argument("--host-discovery-script", metavar="SCRIPT",
                       help="elastic: shell command printing the available hosts, one "
                            "'HOST' or 'HOST:SLOTS' per line; run every second")

    remote = parser.add_argument_group(
        "other machines", "Hosts that are not this machine run their workers over "
                          "password-less ssh ($HORA_SSH_COMMAND replaces 'ssh'), in the "
                          "same working directory.")
    remote.add_argument("--network-interface", "--network-interfaces", dest="network_interface",
                        type=_interface, metavar="NIC",
                        help="network interface the coordinator and every worker listen on, "
                             "e.g. eth0 (horovodrun's comma-separated list: the first is "
                             "used; default: the one that routes to the other hosts)")
    remote.add_argument("-p", "--ssh-port", type=_ssh_port, metavar="PORT",
                        help="ssh port of the remote hosts")
    remote.add_argument("-i", "--ssh-identity-file", metavar="FILE",
                        help="ssh private key for the remote hosts")

    elastic = parser.add_argument_group(
        "elastic", "An elastic job grows and shrinks between --min-np and --max-np "
                   "workers as hosts come and go; any of --min-np, --max-np or "
                   "--host-discovery-script makes a job elastic.")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=_positive_int,
                         metavar="M",
                         help="fewest workers the job runs with (default -np)")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=_positive_int,
                         metavar="X",
                         help="most workers the job runs with (default: no limit)")
    elastic.add_argument("--slots-per-host", type=_positive_int, metavar="N",
                         help="slots of a discovered host printed without ':SLOTS' "
                              "(default 1)")
    elastic.add_argument("--reset-limit", type=_non_negative_int, metavar="N",
                         help="elastic resets a worker may go through (default: no limit)")
    elastic.add_argument("--blacklist-cooldown-range", type=_non_negative_float, nargs=2,
                         metavar=("MIN", "MAX"),
                         help="a host blacklisted after a failure comes back after a random "
                              "MIN..MAX seconds, doubling on each further failure up to MAX "
                              "(default: blacklisted for good)")
    elastic.add_argument("--elastic-timeout", type=_positive_float, metavar="SECONDS",
                         help="seconds the job may stay below --min-np workers (default 600)")

    coord = parser.add_argument_group("coordinator")
    coord.add_argument("--coordinator", type=_address, metavar="HOST:PORT",
                       help="use this running coordinator instead of embedding one")
    coord.add_argument("--coordinator-http-port", type=_port, default=0, metavar="PORT",
                       help="HTTP port of the embedded coordinator (default: ephemeral)")
    coord.add_argument("--job-id", metavar="ID", help="job id (default: a fresh unique id)")
    coord.add_argument("--token", metavar="TOKEN",
                       help="job token (default: $HORA_TOKEN, else random)")

    tuning = parser.add_argument_group("worker settings")
    tuning.add_argument("--fusion-threshold-mb", type=_non_negative_float, metavar="MB",
                        help="largest fusion buffer in MiB (0 disables fusion)")
    tuning.add_argument("--cycle-time-ms", type=_positive_float, metavar="MS",
                        help="milliseconds the background loop batches ready tensors")
    tuning.add_argument("--start-timeout", type=_positive_float, metavar="SECONDS",
                        help="seconds to wait for all workers to join")
    tuning.add_argument("--no-stall-check", dest="no_stall_check", action="store_const",
                        const=True, help="disable the stall check")
    tuning.add_argument("--stall-check", dest="no_stall_check", action="store_const",
                        const=False, help="enable the stall check (the default; undoes "
                                          "--no-stall-check or a --config-file)")
    tuning.add_argument("--stall-check-time", "--stall-check-warning-time-seconds",
                        dest="stall_check_time", type=_non_negative_float, metavar="SECONDS",
                        help="seconds a tensor may wait on some ranks before a warning")
    tuning.add_argument("--stall-shutdown-time", "--stall-check-shutdown-time-seconds",
                        dest="stall_shutdown_time", type=_non_negative_float, metavar="SECONDS",
                        help="seconds a tensor may wait before the job fails (0: never)")
    tuning.add_argument("--timeline-filename", metavar="FILE",
                        help="write a timeline (Chrome trace) to FILE")
    tuning.add_argument("--timeline-mark-cycles", dest="timeline_mark_cycles",
                        action="store_const", const=True,
                        help="mark each agreement round (cycle) in the timeline")
    tuning.add_argument("--no-timeline-mark-cycles", dest="timeline_mark_cycles",
                        action="store_const", const=False, help=argparse.SUPPRESS)
    tuning.add_argument("--autotune", dest="autotune", action="store_const", const=True,
                        help="let workers tune fusion threshold and cycle time")
    tuning.add_argument("--no-autotune", dest="autotune", action="store_const", const=False,
                        help=argparse.SUPPRESS)
    tuning.add_argument("--autotune-log-file", metavar="FILE",
                        help="CSV log of the settings autotune tried")
    tuning.add_argument("--autotune-warmup-samples", type=_non_negative_int, metavar="N",
                        help="autotune: measurement windows discarded before tuning")
    tuning.add_argument("--autotune-bayes-opt-max-samples", type=_positive_int, metavar="N",
                        help="autotune: settings measured before the best one is kept")
    tuning.add_argument("--autotune-steps-per-sample", type=_positive_int, metavar="N",
                        help="accepted from horovodrun; hora's autotuner measures time "
                             "windows instead")
    tuning.add_argument("--autotune-gaussian-process-noise", type=_unit_float, metavar="X",
                        help="accepted from horovodrun; hora's autotuner has no noise "
                             "parameter")
    tuning.add_argument("--gloo-timeout-seconds", type=_positive_float, metavar="SECONDS",
                        help="seconds a data-plane collective may take before it fails")
    tuning.add_argument("--cache-capacity", type=_non_negative_int, metavar="N",
                        help="negotiated allreduces remembered to skip the coordinator "
                             "(0 disables the response cache)")
    tuning.add_argument("--log-level", type=_log_level, metavar="LEVEL",
                        help=f"workers print hora's messages from this level on to stderr "
                             f"({', '.join(LOG_LEVELS)})")
    stamps = tuning.add_mutually_exclusive_group()
    stamps.add_argument("--log-with-timestamp", "--no-log-hide-timestamp",
                        dest="log_with_timestamp", action="store_const", const=True,
                        help="start workers' log messages with the time (the default)")
    stamps.add_argument("--log-without-timestamp", "--log-hide-timestamp",
                        dest="log_with_timestamp", action="store_const", const=False,
                        help="leave the time out of workers' log messages")
    tuning.add_argument("--config-file", metavar="FILE",
                        help="Horovod's YAML configuration file (sections params, autotune, "
                             "timeline, stall_check, library_options, logging); flags on the "
                             "command line win over it")

    noop = parser.add_argument_group(
        "accepted from horovodrun without effect",
        "hora has no such thing; each prints one line saying so.")
    for flag in ("hierarchical-allreduce", "hierarchical-allgather", "mpi-threads-disable"):
        dest = flag.replace("-", "_")
        pair = noop.add_mutually_exclusive_group()
        pair.add_argument(f"--{flag}", dest=dest, action="store_const", const=True)
        pair.add_argument(f"--no-{flag}", dest=dest, action="store_const", const=False)
    noop.add_argument("--torus-allreduce", action="store_const", const=True)
    noop.add_argument("--num-nccl-streams", type=_non_negative_int, metavar="N")
    noop.add_argument("--thread-affinity", type=_non_negative_int, metavar="N")
    noop.add_argument("--binding-args", metavar="ARGS")
    noop.add_argument("--mpi-args", metavar="ARGS")
    noop.add_argument("--disable-cache", action="store_true",
                      help="hora keeps no cache of launcher checks, so there is none to "
                           "disable")

    out = parser.add_argument_group("launcher")
    out.add_argument("--verbose", action="store_true",
                     help="print the placement of ranks on hosts before starting")
    out.add_argument("--output-filename", metavar="DIR",
                     help="also write each rank's output to DIR/rank.N/stdout and stderr")
    out.add_argument("--disable-prefix", action="store_true",
                     help="do not prefix output lines with [RANK]<stream>:")
    out.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp",
                     dest="prefix_timestamp", action="store_true",
                     help="start every output line with the time it was printed")
    out.add_argument("--tcp", action="store_true",
                     help="keep NCCL on TCP sockets (sets NCCL_IB_DISABLE=1 for workers); "
                          "everything else in hora uses TCP or shared memory already")
    out.add_argument("-v", "--version", action="version", version=f"hora {_hora_version()}",
                     help="print hora's version and exit")
    out.add_argument("-cb", "--check-build", action=_CheckBuild,
                     help="print the frameworks, controllers and tensor operations this "
                          "hora can use, in horovodrun's format, and exit")
    controller = out.add_mutually_exclusive_group()
    controller.add_argument("--gloo", action="store_true",
                            help="accepted for horovodrun compatibility (hora always uses "
                                 "Gloo)")
    controller.add_argument("--mpi", action="store_true",
                            help="refused: hora never runs through mpirun")
    controller.add_argument("--jsrun", action="store_true",
                            help="refused: hora never runs through jsrun")
    out.add_argument("--horovod-compat", action=argparse.BooleanOptionalAction,
                     default=horovod_compat,
                     help="let scripts `import horovod.torch` and get hora; refused when a "
                          "real Horovod is installed (default: on for horovodrun)")

    # REMAINDER makes argparse hand over everything from the first positional
    # on, so the command's own flags are never taken for ours.
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND [ARGS...]",
                        help="the command each worker runs")
    return parser


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
        file_notices = _apply_config_file(parser, ns, ns.config_file, from_file)
    notices = [f"ignoring {_flag(dest)}: {why}" for dest, why in IGNORED.items()
               if getattr(ns, dest, None) not in (None, False) and dest not in from_file]
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
    if ns.fusion_threshold_mb is not None:
        settings["fusion_threshold"] = int(ns.fusion_threshold_mb * MiB)
    if ns.cycle_time_ms is not None:
        settings["cycle_time"] = timedelta(milliseconds=ns.cycle_time_ms)
    if ns.start_timeout is not None:
        settings["start_timeout"] = timedelta(seconds=ns.start_timeout)
    if ns.stall_check_time is not None:
        settings["stall_warning_time"] = timedelta(seconds=ns.stall_check_time)
    if ns.stall_shutdown_time is not None:
        settings["stall_shutdown_time"] = timedelta(seconds=ns.stall_shutdown_time)
    if ns.log_level is not None:
        settings["log_level"] = ns.log_level
    if ns.cache_capacity is not None:
        settings["cache_capacity"] = ns.cache_capacity
    if ns.timeline_filename:
        settings["timeline"] = ns.timeline_filename
    if ns.timeline_mark_cycles:
        settings["timeline_mark_cycles"] = True
    if ns.autotune:
        settings["autotune"] = True
    if ns.autotune_log_file:
        settings["autotune_log"] = ns.autotune_log_file
    if ns.autotune_warmup_samples is not None:
        settings["autotune_warmup_samples"] = ns.autotune_warmup_samples
    if ns.autotune_bayes_opt_max_samples is not None:
        settings["autotune_max_samples"] = ns.autotune_bayes_opt_max_samples
    if ns.gloo_timeout_seconds is not None:
        settings["collective_timeout"] = timedelta(seconds=ns.gloo_timeout_seconds)
    if ns.log_with_timestamp is not None:
        settings["log_hide_time"] = not ns.log_with_timestamp
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


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _apply_config_file(parser: argparse.ArgumentParser, ns: argparse.Namespace,
                       path: str, applied: dict[str, str]) -> list[str]:
    """Fills ``ns`` from Horovod's YAML config file where the command line left a gap.

    Values go through the same checks as the flags they stand for.

    Args:
        parser: the parser, for its checks and its errors.
        ns: what the command line gave; filled in place.
        path: the file.
        applied: filled with ``dest -> 'section.key'`` for what the file set.

    Returns:
        Notices for keys that are ignored (unknown, or nothing hora has).

    Raises:
        SystemExit: (via ``parser.error``) the file cannot be read, is not
            YAML mappings, asks for MPI, or holds a value its flag refuses.
    """
    import yaml  # only this flag needs it

    where = f"--config-file {path}"
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except OSError as exc:
        parser.error(f"--config-file: cannot read {path!r}: {exc.strerror or exc}")
    except yaml.YAMLError as exc:
        parser.error(f"{where}: not valid YAML: {exc}")
    config = {} if config is None else config
    if not isinstance(config, dict):
        parser.error(f"{where}: expected sections such as 'params:', got "
                     f"{type(config).__name__}")
    # Each dest's first option: its type is the check a value must pass.
    actions: dict[str, argparse.Action] = {}
    for action in parser._actions:
        actions.setdefault(action.dest, action)
    notices: list[str] = []
    for section, body in config.items():
        if section == "controller":
            if str(body).lower() != "gloo":
                parser.error(f"{where}: controller: {body}: hora runs over Gloo only")
            continue
        if not isinstance(body, dict):
            parser.error(f"{where}: section {section!r} must hold 'key: value' lines")
        for key, value in body.items():
            dest = CONFIG_KEYS.get((section, key))
            name = f"{section}.{key}"
            if dest is None:
                notices.append(f"ignoring {name} in --config-file: not a Horovod setting "
                               f"hora knows")
                continue
            if getattr(ns, dest, None) is not None or value is None:
                continue  # the command line wins
            action = actions.get(dest)
            parsed: Any
            if action is None:  # a key of the file only (ccl_bgt_affinity)
                parsed = value
            elif action.const is not None:
                if not isinstance(value, bool):
                    parser.error(f"{where}: {name}: expected true or false, got {value!r}")
                parsed = (not value) if dest == "no_stall_check" else value
            elif action.type is not None:
                try:
                    parsed = action.type(str(value))
                except argparse.ArgumentTypeError as exc:
                    parser.error(f"{where}: {name}: {exc}")
            else:
                parsed = str(value)
            setattr(ns, dest, parsed)
            applied[dest] = name
            if dest in IGNORED and parsed is not False:
                notices.append(f"ignoring {name} in --config-file: {IGNORED[dest]}")
    return notices


_ELASTIC_ONLY = (
    ("slots_per_host", "--slots-per-host"),
    ("reset_limit", "--reset-limit"),
    ("blacklist_cooldown_range", "--blacklist-cooldown-range"),
    ("elastic_timeout", "--elastic-timeout"),
)


def _elastic_config(parser: argparse.ArgumentParser,
                    ns: argparse.Namespace) -> ElasticConfig | None:
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
    timeout = ns.elastic_timeout if ns.elastic_timeout is not None else 600.0
    return ElasticConfig(
        min_np=min_np,
        max_np=max_np,
        discovery_script=script,
        slots_per_host=ns.slots_per_host if ns.slots_per_host is not None else 1,
        reset_limit=ns.reset_limit,
        cooldown_range=cooldown,
        elastic_timeout=timedelta(seconds=timeout),
    )
