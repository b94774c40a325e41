"""hora's options, each declared once: the table both sides read.

One :class:`Option` per setting names its field, its kind (and so its unit
in the environment and on the wire), its default, its environment names
(``HORA_*`` first, Horovod's ``HOROVOD_*`` aliases after; the first one set
wins), its ``horarun`` flag, its help, and whether it is *job-level*: a
value every rank of a job must share, which the worker sends when it joins
(``JoinRequest.job_options``) and the coordinator stores as it came.

From this table are made: ``hora.settings.Settings.from_env`` and
``to_env`` (worker environment), the launcher's argparse entries
(``hora.runner.flags``), what ``horarun`` passes to its workers
(``hora.runner.args``), the worker's ``job_options`` and the coordinator's
typed reading of them (:func:`job_value`).

Kinds and their text (the environment's and the wire's): ``str``; ``int``;
``optional_int`` (an int, or unset); ``bool`` (``1``/``0``, also
``true``/``yes``/``on``...); ``seconds`` and ``millis`` (a ``timedelta``
written as a number of seconds, or of milliseconds).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = ["LOG_LEVELS", "LAUNCHER_ONLY", "ELASTIC_GROUP", "env_value", "MiB", "Flag", "Option", "OPTIONS", "BY_FIELD", "JOB_LEVEL", "OptionError",
           "parse_bool", "parse_text", "format_value", "default_of", "flag_value",
           "job_options", "job_value", "legacy_join_fields", "LEGACY_JOIN_FIELDS"]

MiB = 1024 * 1024

# Python's names and Horovod's (TRACE, FATAL).
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL", "CRITICAL")

KINDS = ("str", "int", "optional_int", "bool", "seconds", "millis")


class OptionError(ValueError):
    """An option's text does not parse, or names no option."""


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off/''`` (any case)."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean, got {text!r}")


_PARSERS: dict[str, Callable[[str], Any]] = {
    "str": str,
    "int": int,
    "optional_int": int,
    "bool": parse_bool,
    "seconds": lambda text: timedelta(seconds=float(text)),
    "millis": lambda text: timedelta(milliseconds=float(text)),
}


@dataclass(frozen=True)
class Flag:
    """An option's ``horarun`` flag.

    Attributes:
        names: the flag's spellings, first the main one (horovodrun's kept).
        dest: the argparse destination (Horovod's ``--config-file`` keys set it too).
        arg: what the flag takes, by the name of a check in ``hora.runner.flags``
            (``positive_float``, ``non_negative_int``, ``log_level``, ``text``...),
            or ``switch`` (no value: sets True; ``off`` names its hidden opposite).
        metavar: the value's name in ``--help``.
        help: the flag's line in ``--help``.
        group: the ``--help`` section it is listed in.
        scale: flag units per option unit's multiple (``--fusion-threshold-mb``: MiB).
        invert: the flag says the opposite of the option (``--log-with-timestamp``).
        off: a hidden flag that sets the switch False (undoes a config file).
        exclusive: the other flag's spellings, in a mutually exclusive pair.
    """

    names: tuple[str, ...]
    dest: str
    arg: str
    help: str
    metavar: str | None = None
    group: str = "worker settings"
    scale: int = 1
    invert: bool = False
    off: str | None = None
    exclusive: tuple[tuple[str, ...], str] | None = None


@dataclass(frozen=True)
class Option:
    """One setting, declared once (see the module docstring)."""

    field: str
    kind: str
    default: Any
    names: tuple[str, ...]
    help: str
    flag: Flag | None = None
    job_level: bool = False
    default_factory: Callable[[], Any] | None = None

    def parse(self, text: str) -> Any:
        """The value of ``text`` in this option's kind.

        Raises:
            ValueError: the text does not parse.
        """
        return _PARSERS[self.kind](text)


def format_value(option: Option, value: Any) -> str:
    """``value`` as text that :meth:`Option.parse` reads back."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
        return str(seconds * 1000.0) if option.kind == "millis" else str(seconds)
    return str(value)


def default_of(option: Option) -> Any:
    """The option's default value (made fresh where it depends on the machine)."""
    return option.default_factory() if option.default_factory is not None else option.default


def flag_value(option: Option, value: Any) -> Any:
    """The option's value for what its flag parsed (flag units to the option's)."""
    if option.flag is None:
        raise OptionError(f"option {option.field} has no flag")
    if option.kind == "seconds":
        return timedelta(seconds=value)
    if option.kind == "millis":
        return timedelta(milliseconds=value)
    if option.kind == "bool":
        return not value if option.flag.invert else bool(value)
    if option.kind in ("int", "optional_int"):
        return int(value * option.flag.scale)
    return value


def _o(field: str, kind: str, default: Any, names: tuple[str, ...], help: str,
       flag: Flag | None = None, *, job: bool = False,
       factory: Callable[[], Any] | None = None) -> Option:
    return Option(field, kind, default, names, help, flag, job, factory)


#: The ``--help`` section of the elastic flags (the launcher checks them together).
ELASTIC_GROUP = "elastic"
_ELASTIC = ELASTIC_GROUP

OPTIONS: tuple[Option, ...] = (
    _o("coordinator", "str", "", ("HORA_COORDINATOR",), "coordinator gRPC address HOST:PORT"),
    _o("job_id", "str", "default", ("HORA_JOB_ID",), "job the worker joins"),
    _o("token", "str", "", ("HORA_TOKEN",), "job token sent with every gRPC call"),
    # Empty: a plaintext channel to the coordinator (see hora._tls).
    _o("tls_ca", "str", "", ("HORA_TLS_CA",),
       "CA bundle (PEM) that verifies the coordinator's TLS certificate, as a file path or "
       "the PEM text itself; unset: plaintext"),
    _o("size", "int", 1, ("HORA_SIZE", "HOROVOD_SIZE"), "world size the launcher started"),
    _o("rank", "int", -1, ("HORA_RANK", "HOROVOD_RANK"), "rank the launcher assigned"),
    _o("hostname", "str", "", ("HORA_HOSTNAME", "HOROVOD_HOSTNAME"), "host name for local ranks",
       factory=socket.gethostname),
    _o("data_plane_address", "str", "127.0.0.1", ("HORA_DATA_PLANE_ADDRESS",),
       "address the data plane binds to; 'auto': the one that reaches the coordinator"),
    _o("network_interface", "str", "", ("HORA_NETWORK_INTERFACE",),
       "network interface whose address the data plane binds to (overrides the address)"),
    _o("start_timeout", "seconds", timedelta(seconds=60),
       ("HORA_START_TIMEOUT", "HOROVOD_START_TIMEOUT"), "seconds to wait for the world to gather",
       Flag(("--start-timeout",), "start_timeout", "positive_float",
            "seconds to wait for all workers to join", "SECONDS")),
    _o("connect_timeout", "seconds", timedelta(seconds=15), ("HORA_CONNECT_TIMEOUT",),
       "seconds to wait for the coordinator to answer at init"),
    _o("coordinator_outage_timeout", "seconds", timedelta(seconds=60),
       ("HORA_COORDINATOR_OUTAGE_TIMEOUT",),
       "seconds a worker trains on without the coordinator (it restarts, the network "
       "drops) before what needs it fails"),
    _o("collective_timeout", "seconds", timedelta(seconds=300),
       ("HORA_COLLECTIVE_TIMEOUT", "HOROVOD_GLOO_TIMEOUT_SECONDS"),
       "seconds a data-plane collective may take",
       Flag(("--gloo-timeout-seconds",), "gloo_timeout_seconds", "positive_float",
            "seconds a data-plane collective may take before it fails", "SECONDS")),
    _o("heartbeat_interval", "seconds", timedelta(seconds=1), ("HORA_HEARTBEAT_INTERVAL",),
       "seconds between heartbeats when the coordinator names none (it sizes them to "
       "its load)"),
    _o("stall_warning_time", "seconds", timedelta(seconds=60),
       ("HORA_STALL_CHECK_TIME", "HOROVOD_STALL_CHECK_TIME_SECONDS"),
       "seconds a tensor may wait on some ranks before a warning",
       Flag(("--stall-check-time", "--stall-check-warning-time-seconds"), "stall_check_time",
            "non_negative_float", "seconds a tensor may wait on some ranks before a warning",
            "SECONDS"), job=True),
    # Every wait has a deadline: a tensor some live rank never submits fails
    # the job after this long (Horovod's default is never; 0 restores that).
    _o("stall_shutdown_time", "seconds", timedelta(minutes=30),
       ("HORA_STALL_SHUTDOWN_TIME", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"),
       "seconds a tensor may wait on some ranks before the job fails (0: never)",
       Flag(("--stall-shutdown-time", "--stall-check-shutdown-time-seconds"),
            "stall_shutdown_time", "non_negative_float",
            "seconds a tensor may wait before the job fails (0: never)", "SECONDS"), job=True),
    _o("fusion_threshold", "int", 128 * MiB, ("HORA_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"),
       "largest fusion buffer in bytes (0 disables fusion)",
       Flag(("--fusion-threshold-mb",), "fusion_threshold_mb", "non_negative_float",
            "largest fusion buffer in MiB (0 disables fusion)", "MB", scale=MiB), job=True),
    # Rounds start as soon as a tensor is ready: measured faster here than
    # waiting to batch more (see bench/README.md).
    _o("cycle_time", "millis", timedelta(0), ("HORA_CYCLE_TIME", "HOROVOD_CYCLE_TIME"),
       "milliseconds the background loop batches ready tensors",
       Flag(("--cycle-time-ms",), "cycle_time_ms", "positive_float",
            "milliseconds the background loop batches ready tensors", "MS")),
    _o("cache_capacity", "int", 1024, ("HORA_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY"),
       "negotiated allreduces remembered so they skip the coordinator (0 disables)",
       Flag(("--cache-capacity",), "cache_capacity", "non_negative_int",
            "negotiated allreduces remembered to skip the coordinator (0 disables the "
            "response cache)", "N")),
    # Small allreduces ride the agreement round's own exchange: one round trip
    # instead of two exchanges (see bench/README.md for the measurement).
    _o("mesh_allreduce_bytes", "int", 1 * MiB, ("HORA_MESH_ALLREDUCE_BYTES",),
       "cached CPU allreduces up to this many bytes (times ranks - 1) travel with the "
       "round's agreement over direct connections instead of Gloo; with 2 or 4 ranks "
       "that share no memory, larger ones go by swaps between pairs of ranks over those "
       "connections (0: always Gloo)"),
    # Ranks on one machine read each other's tensors in place: about 4 memory
    # passes instead of a trip through loopback TCP (see bench/README.md).
    _o("shm_allreduce_bytes", "int", 64 * MiB, ("HORA_SHM_ALLREDUCE_BYTES",),
       "when all ranks share a machine, cached CPU allreduces up to this many bytes per "
       "round go through shared memory instead of sockets (0: never)"),
    # A small model's gradients stay views of the fused buffer: no copy in or
    # out per step, at the price of zeros (not None) after zero_grad().
    _o("gradient_views", "bool", True, ("HORA_GRADIENT_VIEWS",),
       "a DistributedOptimizer whose gradients go as one allreduce keeps them as views of "
       "its buffer, zeroed in place by zero_grad() (0: copy them in and out every step, "
       "and zero_grad() sets them to None, as torch does)"),
    # Section 2c of bench/README.md: 400 gradient hooks and the buffer's checks
    # cost 0.45-2.1 ms a step in Python, nothing measurable in C++.
    _o("native_hooks", "bool", True, ("HORA_NATIVE_HOOKS",),
       "a DistributedOptimizer whose gradients go as one allreduce notes them and checks "
       "its buffer in C++, compiled on first use into ~/.cache/hora/torch_hooks when a C++ "
       "compiler is installed (0: in Python)"),
    _o("timeline", "str", "", ("HORA_TIMELINE", "HOROVOD_TIMELINE"),
       "Chrome-trace timeline file written by rank 0",
       Flag(("--timeline-filename",), "timeline_filename", "text",
            "write a timeline (Chrome trace) to FILE", "FILE")),
    _o("timeline_mark_cycles", "bool", False,
       ("HORA_TIMELINE_MARK_CYCLES", "HOROVOD_TIMELINE_MARK_CYCLES"),
       "mark each agreement round in the timeline",
       Flag(("--timeline-mark-cycles",), "timeline_mark_cycles", "switch",
            "mark each agreement round (cycle) in the timeline",
            off="--no-timeline-mark-cycles")),
    _o("autotune", "bool", False, ("HORA_AUTOTUNE", "HOROVOD_AUTOTUNE"),
       "tune fusion threshold and cycle time online",
       Flag(("--autotune",), "autotune", "switch",
            "let workers tune fusion threshold and cycle time", off="--no-autotune")),
    _o("autotune_log", "str", "", ("HORA_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_LOG"),
       "CSV log of the settings autotune tried",
       Flag(("--autotune-log-file",), "autotune_log_file", "text",
            "CSV log of the settings autotune tried", "FILE")),
    # None: the autotuner's own defaults.
    _o("autotune_warmup_samples", "optional_int", None,
       ("HORA_AUTOTUNE_WARMUP_SAMPLES", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES"),
       "autotune: measurement windows discarded before tuning starts",
       Flag(("--autotune-warmup-samples",), "autotune_warmup_samples", "non_negative_int",
            "autotune: measurement windows discarded before tuning", "N")),
    _o("autotune_max_samples", "optional_int", None,
       ("HORA_AUTOTUNE_MAX_SAMPLES", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES"),
       "autotune: settings measured before the best one is kept",
       Flag(("--autotune-bayes-opt-max-samples",), "autotune_bayes_opt_max_samples",
            "positive_int", "autotune: settings measured before the best one is kept", "N")),
    # Empty: not configured, so hora installs no log handler of its own and
    # Python's defaults apply (warnings and errors reach stderr).
    _o("log_level", "str", "", ("HORA_LOG_LEVEL", "HOROVOD_LOG_LEVEL"),
       "logging level; when set, hora's messages at that level and above go to stderr",
       Flag(("--log-level",), "log_level", "log_level",
            "workers print hora's messages from this level on to stderr "
            f"({', '.join(LOG_LEVELS)})", "LEVEL")),
    _o("log_hide_time", "bool", False, ("HORA_LOG_HIDE_TIME", "HOROVOD_LOG_HIDE_TIME"),
       "leave the timestamp out of hora's log messages",
       Flag(("--log-with-timestamp", "--no-log-hide-timestamp"), "log_with_timestamp", "switch",
            "start workers' log messages with the time (the default)", invert=True,
            exclusive=(("--log-without-timestamp", "--log-hide-timestamp"),
                       "leave the time out of workers' log messages"))),
    _o("reset_limit", "optional_int", None, ("HORA_RESET_LIMIT", "HOROVOD_RESET_LIMIT"),
       "elastic resets a worker may go through (unset: no limit)",
       Flag(("--reset-limit",), "reset_limit", "non_negative_int",
            "elastic resets a worker may go through (default: no limit)", "N", _ELASTIC)),
    _o("min_size", "int", 0, ("HORA_MIN_SIZE",), "elastic: fewest workers the job runs with",
       Flag(("--min-np", "--min-num-proc"), "min_np", "positive_int",
            "fewest workers the job runs with (default -np)", "M", _ELASTIC), job=True),
    _o("max_size", "int", 0, ("HORA_MAX_SIZE",), "elastic: most workers the job runs with",
       Flag(("--max-np", "--max-num-proc"), "max_np", "positive_int",
            "most workers the job runs with (default: no limit)", "X", _ELASTIC), job=True),
    _o("elastic_timeout", "seconds", timedelta(seconds=600),
       ("HORA_ELASTIC_TIMEOUT", "HOROVOD_ELASTIC_TIMEOUT"),
       "elastic: seconds a round may wait for min_size workers",
       Flag(("--elastic-timeout",), "elastic_timeout", "positive_float",
            "seconds the job may stay below --min-np workers (default 600)", "SECONDS",
            _ELASTIC), job=True),
    # The launcher's, not a worker's: it is not passed on (see hora.runner.remote).
    _o("ssh_command", "str", "", ("HORA_SSH_COMMAND",),
       "the ssh program and fixed arguments the launcher runs remote workers with "
       "(default: ssh)"),
)

BY_FIELD: Mapping[str, Option] = {option.field: option for option in OPTIONS}
JOB_LEVEL: tuple[Option, ...] = tuple(option for option in OPTIONS if option.job_level)
#: Options that stay with the process that reads them (never put in a worker's environment).
LAUNCHER_ONLY = frozenset({"ssh_command"})


def parse_text(option: Option, name: str, text: str) -> Any:
    """``text`` (of variable or key ``name``) parsed in ``option``'s kind.

    Raises:
        OptionError: naming the variable, the value and the option's meaning.
    """
    try:
        return option.parse(text)
    except (ValueError, OverflowError) as exc:  # overflow: a duration of 1e300 s
        raise OptionError(f"{name}={text!r}: {option.help}: {exc}") from exc


def job_options(values: Mapping[str, Any]) -> dict[str, str]:
    """The job-level options among ``values`` (by field), as the join sends them."""
    return {option.field: format_value(option, values[option.field]) for option in JOB_LEVEL}


def job_value(options: Mapping[str, str], field: str) -> Any:
    """The typed value of job-level option ``field`` in a join's ``job_options``;
    its default when the joiner did not send it.

    Raises:
        OptionError: ``field`` is no job-level option, or its text does not parse.
    """
    option = BY_FIELD.get(field)
    if option is None or not option.job_level:
        raise OptionError(f"{field!r} is not a job-level option")
    text = options.get(field)
    return default_of(option) if text is None else parse_text(option, field, text)


def _ms(duration: timedelta) -> int:
    return int(duration.total_seconds() * 1000)


#: JoinRequest's fields 8..13, from before ``job_options``: what the coordinator
#: acts on, in the units those fields carry. Closed: new options go in the map only.
_LEGACY_JOIN_FIELDS: dict[str, Callable[[Mapping[str, str]], int]] = {
    "fusion_threshold_bytes": lambda o: int(job_value(o, "fusion_threshold")),
    "stall_warning_ms": lambda o: _ms(job_value(o, "stall_warning_time")),
    "stall_shutdown_ms": lambda o: _ms(job_value(o, "stall_shutdown_time")),
    "min_size": lambda o: int(job_value(o, "min_size")),
    "max_size": lambda o: int(job_value(o, "max_size")),
    "elastic_timeout_ms": lambda o: _ms(job_value(o, "elastic_timeout")),
}


#: Their names, in field order.
LEGACY_JOIN_FIELDS = tuple(_LEGACY_JOIN_FIELDS)


def legacy_join_fields(options: Mapping[str, str]) -> dict[str, int]:
    """JoinRequest's deprecated fields 8..13 made from a join's ``job_options``: a
    worker sends both (a coordinator older than the map reads the fields), and the
    coordinator reads its values through this.

    Raises:
        OptionError: a value does not parse.
    """
    return {name: read(options) for name, read in _LEGACY_JOIN_FIELDS.items()}


def env_value(environ: Mapping[str, str], option: Option) -> Any:
    """``option``'s value in ``environ``: its first name set to a non-empty text,
    parsed; None when none is set.

    Raises:
        OptionError: that variable's text does not parse.
    """
    for name in option.names:
        raw = environ.get(name)
        if raw:
            return parse_text(option, name, raw)
    return None
