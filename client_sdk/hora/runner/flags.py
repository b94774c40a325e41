"""The flags of ``horarun``: its argparse parser and the check of each value.

Flags follow horovodrun's spelling so that a Horovod user's command line
works unchanged, elastic ones included. Each value is checked as it is
parsed (a port in range, a known log level, ...), so a bad one fails with
argparse's usage message and exit code 2. What the values mean together
is :mod:`.args`'s business.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora_proto.options import ELASTIC_GROUP, LOG_LEVELS, OPTIONS

from .horovod_flags import IGNORED

__all__ = ["build_parser", "check_build_report", "parse_address"]


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


# What --check-build probes per framework: the framework and hora's binding for it
# must both import. MXNet has no hora binding.
FRAMEWORK_PROBES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("TensorFlow", ("tensorflow", "hora.tensorflow")),
    ("PyTorch", ("torch", "hora.torch")),
    ("MXNet", ()),
    ("Keras", ("keras", "hora.tensorflow.keras")),
    ("PyTorch Lightning", ("lightning.pytorch", "hora.lightning")),
)
_PROBE = "import importlib, sys\nfor name in sys.argv[1:]: importlib.import_module(name)"
PROBE_TIMEOUT_S = 120.0


def importable_frameworks(timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, bool]:
    """Which frameworks import here, each tried in a child Python of its own.

    A child per framework, all at once: a framework that is absent, broken,
    slow (TensorFlow takes seconds) or that crashes the interpreter on import
    marks only its own line unavailable, and the launcher imports none of them.
    """
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    children = {
        name: subprocess.Popen([sys.executable, "-c", _PROBE, *modules], env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        for name, modules in FRAMEWORK_PROBES if modules}
    deadline = time.monotonic() + timeout_s
    found = {name: False for name, _ in FRAMEWORK_PROBES}
    for name, child in children.items():
        try:
            found[name] = child.wait(timeout=max(0.1, deadline - time.monotonic())) == 0
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return found


def check_build_report() -> str:
    """What ``horovodrun --check-build`` prints, for this installation."""
    # Imported here: only this flag needs torch in the launcher.
    from hora.torch.mpi_ops import gloo_built, nccl_built

    def line(built: object, name: str) -> str:
        return f"    [{'X' if built else ' '}] {name}\n"

    frameworks = importable_frameworks()
    return (f"hora v{_hora_version()} (Horovod API):\n\n"
            "Available Frameworks:\n" + "".join(line(ok, name) for name, ok in frameworks.items())
            + "\nAvailable Controllers:\n" + line(False, "MPI")
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


# What a table flag's ``arg`` names (see hora_proto.options.Flag).
_CHECKS: dict[str, Callable[[str], Any]] = {
    "positive_int": _positive_int,
    "non_negative_int": _non_negative_int,
    "positive_float": _positive_float,
    "non_negative_float": _non_negative_float,
    "log_level": _log_level,
    "text": str,
}


def _add_option_flags(groups: Mapping[str, Any]) -> None:
    """Adds the flags of the options table (:data:`hora_proto.options.OPTIONS`)
    that belong to ``groups`` (``--help`` section name to argparse group)."""
    for option in OPTIONS:
        flag = option.flag
        if flag is None or flag.group not in groups:
            continue
        group = groups[flag.group]
        if flag.arg != "switch":
            group.add_argument(*flag.names, dest=flag.dest, type=_CHECKS[flag.arg],
                               metavar=flag.metavar, help=flag.help)
            continue
        if flag.exclusive is not None:
            group = group.add_mutually_exclusive_group()
        group.add_argument(*flag.names, dest=flag.dest, action="store_const", const=True,
                           help=flag.help)
        if flag.off is not None:
            group.add_argument(flag.off, dest=flag.dest, action="store_const", const=False,
                               help=argparse.SUPPRESS)
        if flag.exclusive is not None:
            names, help_text = flag.exclusive
            group.add_argument(*names, dest=flag.dest, action="store_const", const=False,
                               help=help_text)


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
    _add_option_flags({ELASTIC_GROUP: elastic})
    elastic.add_argument("--slots-per-host", type=_positive_int, metavar="N",
                         help="slots of a discovered host printed without ':SLOTS' "
                              "(default 1)")
    elastic.add_argument("--blacklist-cooldown-range", type=_non_negative_float, nargs=2,
                         metavar=("MIN", "MAX"),
                         help="a host blacklisted after a failure comes back after a random "
                              "MIN..MAX seconds, doubling on each further failure up to MAX "
                              "(default: blacklisted for good)")
    coord = parser.add_argument_group("coordinator")
    coord.add_argument("--coordinator", type=_address, metavar="HOST:PORT",
                       help="use this running coordinator instead of embedding one")
    coord.add_argument("--coordinator-http-port", type=_port, default=0, metavar="PORT",
                       help="HTTP port of the embedded coordinator (default: ephemeral); "
                            "with --coordinator, the running one's, for the dashboard URL "
                            "horarun prints")
    coord.add_argument("--job-id", metavar="ID", help="job id (default: a fresh unique id)")
    coord.add_argument("--token", metavar="TOKEN",
                       help="job token (default: $HORA_TOKEN, else random)")
    coord.add_argument("--tls", action="store_true",
                       help="encrypt the job's gRPC and HTTP: the embedded coordinator serves "
                            "TLS with a certificate from a CA made for this job alone, and "
                            "the workers get that CA")
    coord.add_argument("--tls-ca", metavar="FILE",
                       help="CA bundle (PEM) that signed the certificate of the --coordinator, "
                            "which serves TLS; the workers get it too (default: $HORA_TLS_CA)")

    tuning = parser.add_argument_group("worker settings")
    _add_option_flags({"worker settings": tuning})
    tuning.add_argument("--no-stall-check", dest="no_stall_check", action="store_const",
                        const=True, help="disable the stall check")
    tuning.add_argument("--stall-check", dest="no_stall_check", action="store_const",
                        const=False, help="enable the stall check (the default; undoes "
                                          "--no-stall-check or a --config-file)")
    tuning.add_argument("--autotune-steps-per-sample", type=_positive_int, metavar="N",
                        help=IGNORED["autotune_steps_per_sample"])
    tuning.add_argument("--autotune-gaussian-process-noise", type=_unit_float, metavar="X",
                        help=IGNORED["autotune_gaussian_process_noise"])
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
        pair.add_argument(f"--{flag}", dest=dest, action="store_const", const=True,
                          help=IGNORED[dest])
        pair.add_argument(f"--no-{flag}", dest=dest, action="store_const", const=False)
    noop.add_argument("--torus-allreduce", action="store_const", const=True,
                      help=IGNORED["torus_allreduce"])
    noop.add_argument("--num-nccl-streams", type=_non_negative_int, metavar="N",
                      help=IGNORED["num_nccl_streams"])
    noop.add_argument("--thread-affinity", type=_non_negative_int, metavar="N",
                      help=IGNORED["thread_affinity"])
    noop.add_argument("--binding-args", metavar="ARGS", help=IGNORED["binding_args"])
    noop.add_argument("--mpi-args", metavar="ARGS", help=IGNORED["mpi_args"])

    out = parser.add_argument_group("launcher")
    # Accepted silently: asking to skip a cache hora does not keep changes nothing.
    out.add_argument("--disable-cache", action="store_true",
                     help="accepted from horovodrun; hora keeps no cache of launcher checks, "
                          "so there is none to disable")
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
